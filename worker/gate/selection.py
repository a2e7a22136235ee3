"""Which backend `TOXFLEET_BACKEND=auto` runs: the decision the fidelity gate wrote, if it still holds.

`auto` uses the gate's choice (`worker.gate.decision`) only while it is valid for what runs now;
otherwise it runs the reference, `torch`, and says why (and `worker.gate.background` may gate this
CPU at run time). Nothing is measured here, and nothing imports torch: the main process resolves the
name once before it forks (`worker.state` hands it to the pool processes), and every loader of a
backend (`worker.backends.loader`) is handed a resolved name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.backends import registry
from worker.backends.base import REDUCED
from worker.gate.decision import Decision
from worker.onnx_export.artifacts import (
    DECISION_FILE,
    ExportError,
    export_location,
    verify_export,
    verify_int8_recipe,
)
from worker.settings import WorkerSettings

REFERENCE = "torch"
"""What `auto` runs without a valid decision: Detoxify's own model, fp32."""


@dataclass(frozen=True)
class Resolution:
    """What `auto` (or a name) resolved to in one process: made once, in the worker's main process
    before it forks, and inherited by its pool processes, so the checkpoint is hashed once."""

    name: str
    why: str
    decision: Decision | None = None
    """The valid decision behind `name` (auto only)."""
    directory: Path | None = None
    """This checkpoint's export directory (auto and ONNX backends)."""
    sha: str | None = None
    """The checkpoint's sha256 (auto and ONNX backends)."""

    @property
    def decided(self) -> bool:
        """Whether nothing is left to decide: a backend set by name, or `auto` with a valid decision."""
        return self.decision is not None or self.why == BY_NAME


BY_NAME = "TOXFLEET_BACKEND"
"""The reason of a backend set by name."""


def decision_at(directory: Path, sha: str) -> Decision | str:
    """The decision in `directory` if it holds for checkpoint `sha` on this CPU and these versions;
    otherwise why not (with the command that makes one)."""
    try:
        decision = Decision.read(directory)
    except FileNotFoundError:
        return (f"no fidelity decision at {directory / DECISION_FILE}; "
                "run `python -m worker.export` on this machine to gate the faster backends")
    except (ValueError, TypeError) as exc:
        return f"unreadable {directory / DECISION_FILE} ({exc})"
    reason = decision.invalid_because(sha)
    if reason is not None:
        return f"{reason}; rerun `python -m worker.export` here"
    return decision


def valid_decision(settings: WorkerSettings) -> Decision | str:
    """The gate's decision for this checkpoint, if it still holds for this CPU and these library
    versions; otherwise why not (with the command that makes one)."""
    try:
        directory, sha = export_location(settings)
    except ExportError as exc:
        return str(exc)
    return decision_at(directory, sha)


def chosen_row(decision: Decision) -> dict[str, Any]:
    """The gate row of the backend the decision chose (empty if the decision lacks it)."""
    return next((r for r in decision.rows if r.get("backend") == decision.chosen), {})


def figures(decision: Decision) -> dict[str, Any]:
    """The gate figures behind the backend a decision chose (for the heartbeat and `/readyz`)."""
    row = chosen_row(decision)
    flips = row.get("flip_fraction")
    return {"max_abs": row.get("max_abs"), "p99_abs": row.get("p99_abs"),
            "flips_pct": round(100 * flips, 3) if isinstance(flips, int | float) else None,
            "min_spearman": row.get("min_spearman"), "texts_per_s": row.get("texts_per_s"),
            "decided_at": decision.created}


def gate_figures(settings: WorkerSettings, name: str) -> dict[str, Any] | None:
    """The gate figures behind backend `name` when `auto` chose it from a valid decision (for the
    heartbeat and `/readyz`); None for a backend set by name or run without a decision."""
    if settings.backend != "auto":
        return None
    decision = valid_decision(settings)
    if isinstance(decision, str) or decision.chosen != name:
        return None
    return figures(decision)


def why_chosen(decision: Decision) -> str:
    """The reason `auto` runs what a decision chose, for logs, the heartbeat and `/readyz`."""
    row = chosen_row(decision)
    return (f"fastest that passed the fidelity gate: {_number(row.get('texts_per_s'), '.1f')} "
            f"texts/s, max abs diff {_number(row.get('max_abs'), '.2e')}")


def resolve(settings: WorkerSettings) -> Resolution:
    """What these settings run, and why; hashes the checkpoint at most once (explicit names pass through)."""
    if settings.backend != "auto":
        return Resolution(settings.backend, BY_NAME)
    try:
        directory, sha = export_location(settings)
    except ExportError as exc:
        return Resolution(REFERENCE, f"reference: {exc}")
    decision = decision_at(directory, sha)
    if isinstance(decision, str):
        return Resolution(REFERENCE, f"reference: {decision}", None, directory, sha)
    return Resolution(decision.chosen, why_chosen(decision), decision, directory, sha)


def resolve_backend(settings: WorkerSettings) -> tuple[str, str]:
    """(backend name, why) for these settings; explicit names pass through unchanged."""
    resolution = resolve(settings)
    return resolution.name, resolution.why


def _number(value: Any, spec: str) -> str:
    """A gate figure for the log line; `?` when the decision lacks it."""
    return format(value, spec) if isinstance(value, int | float) else "?"


def verify_for(name: str, settings: WorkerSettings) -> None:
    """ExportError (saying why and what to run) unless backend `name`'s export, if it loads one, is usable."""
    spec = registry.spec(name)
    if spec.runtime == registry.ONNX:
        directory, sha = export_location(settings)
        manifest = verify_export(directory, sha)
        if spec.precision == REDUCED:
            verify_int8_recipe(directory, manifest)


def check(settings: WorkerSettings) -> Resolution:
    """Resolve the backend and, for an ONNX one, verify its export before any pool process starts
    (ExportError says why and what to run)."""
    resolution = resolve(settings)
    verify_for(resolution.name, settings)
    return resolution


def check_backend(settings: WorkerSettings) -> tuple[str, str]:
    """`check`, as (name, why)."""
    resolution = check(settings)
    return resolution.name, resolution.why
