"""Which backend `TOXFLEET_BACKEND=auto` runs: the decision the fidelity gate wrote, if it still holds.

The gate (`python -m worker.export` or `python -m worker.fidelity --write-decision`) measures every
backend against the torch reference on this checkpoint and CPU and writes `decision.json` into the
checkpoint's export directory: its table and the fastest backend that passed. `auto` uses that
choice only while it is valid for what runs now (same checkpoint, same kernel-relevant CPU flags,
same torch/onnxruntime/transformers versions); otherwise it runs the reference, `torch`, and logs
why. Nothing is measured here, and nothing imports torch: the main process may call this too.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.cpus import cpu_model_name, kernel_signature
from worker.export import DECISION_FILE, ExportError, export_location, installed_version
from worker.settings import WorkerSettings

DECISION_FORMAT = 1
"""Version of decision.json; another version is ignored (auto falls back to the reference)."""

DECIDING_VERSIONS = ("torch", "onnxruntime", "transformers")
"""Packages whose version changes the kernels or the tokenizer the gate measured."""

REFERENCE = "torch"
"""What `auto` runs without a valid decision: Detoxify's own model, fp32."""


@dataclass
class Decision:
    """The gate's verdict for one checkpoint on one kind of CPU."""

    checkpoint_sha256: str
    chosen: str
    rows: list[dict[str, Any]]
    threads: int
    texts: int
    kernel_signature: str = field(default_factory=kernel_signature)
    cpu: str = field(default_factory=cpu_model_name)
    versions: dict[str, str | None] = field(
        default_factory=lambda: {d: installed_version(d) for d in DECIDING_VERSIONS})
    format: int = DECISION_FORMAT
    created: float = field(default_factory=time.time)

    def write(self, directory: Path) -> Path:
        path = directory / DECISION_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, directory: Path) -> Decision:
        return cls(**json.loads((directory / DECISION_FILE).read_text()))

    def invalid_because(self, checkpoint_sha: str) -> str | None:
        """Why this decision does not hold for what runs now, or None if it does."""
        if self.format != DECISION_FORMAT:
            return f"decision format {self.format}, expected {DECISION_FORMAT}"
        if self.checkpoint_sha256 != checkpoint_sha:
            return "decision was made for another checkpoint"
        signature = kernel_signature()
        if self.kernel_signature != signature:
            return f"decision was made on a CPU with [{self.kernel_signature}], this one has [{signature}]"
        for dist in DECIDING_VERSIONS:
            have, made = installed_version(dist), self.versions.get(dist)
            # A package absent now (torch in an ONNX-only image) matters only if the choice needs it.
            if have is not None and have != made:
                return f"decision was made with {dist} {made}, this worker has {have}"
        if self.chosen.startswith("torch") and installed_version("torch") is None:
            return f"decision chose {self.chosen} but torch is not installed"
        return None


def resolve_backend(settings: WorkerSettings) -> tuple[str, str]:
    """(backend name, why) for these settings; explicit names pass through unchanged."""
    if settings.backend != "auto":
        return settings.backend, "TOXFLEET_BACKEND"
    try:
        directory, sha = export_location(settings)
    except ExportError as exc:
        return REFERENCE, f"reference: {exc}"
    try:
        decision = Decision.read(directory)
    except FileNotFoundError:
        return REFERENCE, (f"reference: no fidelity decision at {directory / DECISION_FILE}; "
                           "run `python -m worker.export` on this machine to gate the faster backends")
    except (ValueError, TypeError) as exc:
        return REFERENCE, f"reference: unreadable {directory / DECISION_FILE} ({exc})"
    reason = decision.invalid_because(sha)
    if reason is not None:
        return REFERENCE, f"reference: {reason}; rerun `python -m worker.export` here"
    row = next((r for r in decision.rows if r.get("backend") == decision.chosen), {})
    return decision.chosen, (f"fastest that passed the fidelity gate: {_number(row.get('texts_per_s'), '.1f')} "
                             f"texts/s, max abs diff {_number(row.get('max_abs'), '.2e')}")


def _number(value: Any, spec: str) -> str:
    """A gate figure for the log line; `?` when the decision lacks it."""
    return format(value, spec) if isinstance(value, int | float) else "?"


def check_backend(settings: WorkerSettings) -> tuple[str, str]:
    """Resolve the backend and, for an ONNX one, verify its export before any pool process starts
    (ExportError says why and what to run); returns (name, why)."""
    name, why = resolve_backend(settings)
    if name.startswith("onnx"):
        from worker.export import verify_export

        directory, sha = export_location(settings)
        verify_export(directory, sha)
    return name, why
