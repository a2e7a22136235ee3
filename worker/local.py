"""Scoring in the caller's own process, with the worker's scorer: the entry of `toxfleet score --local`.

The CLI imports this only for `--local` (it needs the `worker` extra); everything else it does goes
through the HTTP API.
"""

from __future__ import annotations

from worker.scorer import Scorer
from worker.settings import WorkerSettings
from worker.state import load_scorer


def load_local_scorer(threads: int) -> Scorer:
    """The configured backend (TOXFLEET_* settings, `auto` resolved as a worker does) on `threads` intra-op
    threads, in a Scorer. ImportError when torch or Detoxify (the `worker` extra) is missing."""
    return load_scorer(WorkerSettings(torch_threads=threads))
