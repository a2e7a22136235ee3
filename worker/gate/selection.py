"""Which backend `TOXFLEET_BACKEND=auto` runs: the decision the fidelity gate wrote, if it still holds.

`auto` uses the gate's choice (`worker.gate.decision`) only while it is valid for what runs now;
otherwise it runs the reference, `torch`, and says why. Nothing is measured here, and nothing
imports torch: the main process resolves the name before it forks, and every loader of a backend
(`worker.backends.loader`) is handed a resolved name.
"""

from __future__ import annotations

from typing import Any

from worker.exports.artifacts import DECISION_FILE, ExportError, export_location, verify_export
from worker.gate.decision import Decision
from worker.settings import WorkerSettings

REFERENCE = "torch"
"""What `auto` runs without a valid decision: Detoxify's own model, fp32."""


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
        directory, sha = export_location(settings)
        verify_export(directory, sha)
    return name, why
