"""This pool process's scorer: loaded when the process starts, read by every batch it runs, and
replaced between two batches when the main process switches the worker to another backend.

`worker.lifecycle` resolves the backend once, in the main process, before it forks (`resolved`), and
creates the shared `Switch` the main process later writes (a runtime gate's choice) and each pool
process reads before a batch. `worker.lifecycle` loads the scorer at `worker_process_init`, in the pool
process (that is where batches run); a task applied eagerly, in a process that never had that signal,
resolves and loads it on first use.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from typing import Any, cast

from worker.backends.loader import load_backend
from worker.gate.selection import Resolution, resolve
from worker.scorer import Scorer, planned
from worker.settings import WorkerSettings, get_settings

logger = logging.getLogger(__name__)

NAME_BYTES = 64
"""Room for a backend name in the shared switch."""


class Switch:
    """Shared memory, made in the main process before the fork: which backend the pool processes should
    run, and a generation the main process bumps each time it changes that."""

    def __init__(self, name: str) -> None:
        self._generation: Any = multiprocessing.Value("i", 0)
        self._name: Any = cast(Any, multiprocessing.Array("c", NAME_BYTES))
        self._name.value = name.encode()

    def set(self, name: str) -> int:
        """Point the pool processes at backend `name`; returns the new generation."""
        with self._generation.get_lock():
            self._name.value = name.encode()[:NAME_BYTES - 1]
            self._generation.value += 1
            return int(self._generation.value)

    def read(self) -> tuple[int, str]:
        """(generation, backend name) as the main process last set them."""
        with self._generation.get_lock():
            return int(self._generation.value), self._name.value.decode()


resolved: Resolution | None = None
"""What the main process resolved before forking (pool processes inherit it); None when run eagerly."""

switch: Switch | None = None
"""Set by the main process before forking; None when run eagerly (no switching)."""

_scorer: Scorer | None = None
_generation = 0
"""The switch generation this process's scorer answers to (a failed load counts as seen)."""


def load_scorer(settings: WorkerSettings, name: str | None = None) -> Scorer:
    """Build backend `name` (default: what was resolved, in this process if nothing was inherited) and
    wrap it in a Scorer that plans passes with the backend's own cost of a pass (timed here unless
    configured)."""
    resolution = resolved if resolved is not None else resolve(settings)
    if name is None:
        name = resolution.name
    if settings.backend == "auto":
        why = resolution.why if name == resolution.name else "chosen by the runtime gate"
        logger.info("TOXFLEET_BACKEND=auto: using %s (%s)", name, why)
    backend = load_backend(name, settings)
    return planned(backend, settings.pass_tokens, settings.pass_texts, settings.pass_overhead_tokens)


def load(settings: WorkerSettings) -> Scorer:
    """Load this process's scorer (replacing any earlier one): the backend the switch names now, else
    the resolved one; returns it."""
    global _scorer, _generation
    if switch is not None:
        _generation, name = switch.read()
        _scorer = load_scorer(settings, name)
    else:
        _scorer = load_scorer(settings)
    return _scorer


def _follow(current: Scorer) -> Scorer:
    """The scorer for the next batch: `current`, or the backend the switch names now if it changed
    since. A backend that fails to load leaves `current` in place (logged)."""
    global _scorer, _generation
    assert switch is not None
    generation, name = switch.read()
    if generation == _generation:
        return current
    _generation = generation
    if name == current.backend.name:
        return current
    started = time.perf_counter()
    try:
        _scorer = load_scorer(get_settings(), name)
    except Exception as exc:
        logger.error("pool process %d: cannot switch from %s to %s (%r); keeping %s", os.getpid(),
                     current.backend.name, name, exc, current.backend.name)
        return current
    logger.info("pool process %d switched from %s to %s between batches (loaded in %.2fs)", os.getpid(),
                current.backend.name, name, time.perf_counter() - started)
    return _scorer


def scorer() -> Scorer:
    """The scorer for the batch about to run: loaded at pool-process init (or on first use when run
    eagerly), switched first if the main process chose another backend since the last batch."""
    current = _scorer if _scorer is not None else load(get_settings())
    return _follow(current) if switch is not None else current
