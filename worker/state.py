"""This pool process's scorer: loaded once when the process starts, read by every batch it runs.

`worker.lifecycle` loads it at `worker_process_init`, in the pool process (that is where batches
run); a task applied eagerly, in a process that never had that signal, loads it on first use.
"""

from __future__ import annotations

import logging

from worker.backends.loader import load_backend
from worker.gate.selection import resolve_backend
from worker.scorer import Scorer, planned
from worker.settings import WorkerSettings, get_settings

logger = logging.getLogger(__name__)

_scorer: Scorer | None = None


def load_scorer(settings: WorkerSettings) -> Scorer:
    """Resolve the configured backend (`auto` included), build it in this process, wrap it in a Scorer
    that plans passes with the backend's own cost of a pass (timed here unless configured)."""
    name, reason = resolve_backend(settings)
    if settings.backend == "auto":
        logger.info("TOXFLEET_BACKEND=auto: using %s (%s)", name, reason)
    backend = load_backend(name, settings)
    return planned(backend, settings.pass_tokens, settings.pass_texts, settings.pass_overhead_tokens)


def load(settings: WorkerSettings) -> Scorer:
    """Load this process's scorer (replacing any earlier one) and return it."""
    global _scorer
    _scorer = load_scorer(settings)
    return _scorer


def scorer() -> Scorer:
    """This process's scorer, loaded at pool-process init (or on first use when run eagerly)."""
    return _scorer if _scorer is not None else load(get_settings())
