"""Which backend `TOXFLEET_BACKEND=auto` runs: the decision the fidelity gate wrote, if it still holds.

`auto` uses the gate's choice (`worker.gate.decision`) only while it is valid for what runs now;
otherwise it runs the reference, `torch`, and says why. Nothing is measured here, and nothing
imports torch: the main process resolves the name before it forks, and every loader of a backend
(`worker.backends.loader`) is handed a resolved name.
"""

from __future__ import annotations

from typing import Any

from worker.exports.artifacts import (
    DECISION_FILE,
    ExportError,
    export_location,
    verify_export,
    verify_int8_recipe,
)
from worker.gate.decision import Decision
from worker.settings import WorkerSettings

REFERENCE = "torch"
"""What `auto` runs without a valid decision: Detoxify's own model, fp32."""


def valid_decision(settings: WorkerSettings) -> Decision | str:
    """The gate's decision for this checkpoint, if it still holds for this CPU and these library
    versions; otherwise why not (with the command that makes one)."""
    try:
        directory, sha = export_location(settings)
    except ExportError as exc:
        return str(exc)
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


def chosen_row(decision: Decision) -> dict[str, Any]:
    """The gate row of the backend the decision chose (empty if the decision lacks it)."""
    return next((r for r in decision.rows if r.get("backend") == decision.chosen), {})


def gate_figures(settings: WorkerSettings, name: str) -> dict[str, Any] | None:
    """The gate figures behind backend `name` when `auto` chose it from a valid decision (for the
    heartbeat and `/readyz`); None for a backend set by name or run without a decision."""
    if settings.backend != "auto":
        return None
    decision = valid_decision(settings)
    if isinstance(decision, str) or decision.chosen != name:
        return None
    row = chosen_row(decision)
    flips = row.get("flip_fraction")
    return {"max_abs": row.get("max_abs"), "p99_abs": row.get("p99_abs"),
            "flips_pct": round(100 * flips, 3) if isinstance(flips, int | float) else None,
            "min_spearman": row.get("min_spearman"), "texts_per_s": row.get("texts_per_s"),
            "decided_at": decision.created}


def resolve_backend(settings: WorkerSettings) -> tuple[str, str]:
    """(backend name, why) for these settings; explicit names pass through unchanged."""
    if settings.backend != "auto":
        return settings.backend, "TOXFLEET_BACKEND"
    decision = valid_decision(settings)
    if isinstance(decision, str):
        return REFERENCE, f"reference: {decision}"
    row = chosen_row(decision)
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
        manifest = verify_export(directory, sha)
        if name == "onnx-int8":
            verify_int8_recipe(directory, manifest)
    return name, why
