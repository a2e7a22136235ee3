"""What a gate run reports besides its rows: where it spent its time (`GateRecord`) and how far a long
step has got (`Percent`). Bookkeeping rather than measuring, so it lives apart from `worker.gate.fidelity`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROGRESS_STEP = 10
"""Percent of a long step's texts between two progress lines."""


@dataclass
class GateRecord:
    """Where one gate run spent its time (`python -m worker.gate --timing`), and whether it scored the
    corpus with the reference or read the reference's kept scores (`worker.gate.reference`)."""

    reference: str = ""
    """`cached` (read from the export directory), or `computed` (scored here; `stored` says whether kept)."""
    reference_texts_scored: int = 0
    """Corpus texts the reference scored in this run, counted pass by pass: 0 when its scores were kept."""
    stored: str | None = None
    """Where the scores computed here were kept, or why they were not."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """One entry per step: backend, step (`reference scores`, `load`, `speed`, `fidelity`), seconds."""
    seconds: float = 0.0
    """The whole gate, wall clock."""
    cpu_seconds: float = 0.0
    """The whole gate, CPU time of this process (all its threads): on a shared machine, close to the
    wall time the gate takes on idle cores."""

    def timed(self, backend: str, step: str, started: float) -> None:
        self.steps.append({"backend": backend, "step": step, "seconds": round(time.perf_counter() - started, 3)})


class Percent:
    """Reports `label: N%` each time the texts done cross another `step` percent of `total`."""

    def __init__(self, progress: Callable[[str], None], label: str, total: int, step: int = PROGRESS_STEP) -> None:
        self.progress, self.label, self.total, self.step = progress, label, max(1, total), step
        self.done = 0
        self.next = step

    def add(self, n: int) -> None:
        self.done += n
        percent = self.done * 100 // self.total
        if percent >= self.next:
            self.progress(f"{self.label}: {percent}% ({self.done}/{self.total} texts)")
            self.next = (percent // self.step + 1) * self.step
