"""Prometheus metrics of the inference tier, summed over a worker's processes.

Batches run in prefork pool processes, so this uses prometheus_client's multiprocess mode: every
process writes its samples to its own memory-mapped file in `PROMETHEUS_MULTIPROC_DIR`, and the
worker's main process serves their sum at `:TOXFLEET_METRICS_PORT/metrics`. Files of processes that
exited stay (counters must not go backwards when the pool replaces a process).

prometheus_client chooses multiprocess mode from the environment when it is imported, so metrics are
created lazily here: the main process sets `PROMETHEUS_MULTIPROC_DIR` in `worker_init`, before the
pool forks and before any metric exists. Recording is a few writes to a memory-mapped file per batch.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery import signals

from toxfleet.contract import LATENCY_BUCKETS
from worker.scorer import ScoreStats
from worker.settings import get_settings

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Requests or texts per batch."""

TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
"""Tokens per batch."""

OUTCOMES = ("succeeded", "failed", "skipped", "deferred", "cancelled")
"""Values of `toxfleet_tasks_total`'s `outcome` label."""

FAILURE_REASONS = ("invalid", "scoring", "worker_lost")
"""Values of `toxfleet_task_failures_total`'s `reason` label."""


class WorkerMetrics:
    """The worker's metric objects (one set per process, created on first use)."""

    def __init__(self, registry: Any = None) -> None:
        # Not at module level: prometheus_client picks multiprocess mode when imported (see above).
        from prometheus_client import REGISTRY, Counter, Histogram

        reg = REGISTRY if registry is None else registry
        self.batch_requests = Histogram("toxfleet_batch_requests", "Task messages (requests) scored in one batch.",
                                        buckets=COUNT_BUCKETS, registry=reg)
        self.batch_texts = Histogram("toxfleet_batch_texts", "Texts scored in one batch.",
                                     buckets=COUNT_BUCKETS, registry=reg)
        self.batch_tokens = Histogram("toxfleet_batch_tokens", "Real (unpadded) tokens in one batch.",
                                      buckets=TOKEN_BUCKETS, registry=reg)
        self.inference = Histogram("toxfleet_inference_seconds", "Seconds one batch spent in the model "
                                   "(tokenize and forward passes).", buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_wait = Histogram("toxfleet_queue_wait_seconds", "Seconds from the API publishing a task message "
                                    "to its batch starting (messages sent without the header are not counted).",
                                    buckets=LATENCY_BUCKETS, registry=reg)
        self.texts = Counter("toxfleet_texts_scored", "Texts scored.", registry=reg)
        self.tokens = Counter("toxfleet_tokens", "Real tokens scored.", registry=reg)
        self.padded_tokens = Counter("toxfleet_padded_tokens", "Tokens computed, padding included "
                                     "(tokens / padded_tokens is the padding efficiency).", registry=reg)
        self.passes = Counter("toxfleet_forward_passes", "Model forward passes.", registry=reg)
        self.tasks = Counter("toxfleet_tasks", "Task messages finished, by outcome: succeeded, failed, skipped "
                             "(a redelivered message whose result was already stored), deferred (a "
                             "redelivery while another batch holds the request's lease: left for Redis to "
                             "redeliver), or cancelled (its job was deleted before it was scored).",
                             ["outcome"], registry=reg)
        self.failures = Counter("toxfleet_task_failures", "Task messages failed, by reason: invalid (bad input), "
                                "scoring (the model raised), worker_lost (its process died on every attempt).",
                                ["reason"], registry=reg)
        self.cache_lookups = Counter("toxfleet_cache_lookups", "Texts looked up in the score cache before scoring.",
                                     registry=reg)
        # Every label value exported at 0 from the start: an alert on increase() would miss the first
        # failure of a series that appears already at 1.
        for outcome in OUTCOMES:
            self.tasks.labels(outcome)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.cache_hits = Counter("toxfleet_cache_hits", "Texts answered from the score cache instead of the model "
                                  "(hits / lookups is the workers' hit rate).", registry=reg)


_metrics: WorkerMetrics | None = None


def metrics() -> WorkerMetrics:
    global _metrics
    if _metrics is None:
        _metrics = WorkerMetrics()
    return _metrics


def observe_batch(requests: int, stats: ScoreStats, seconds: float) -> None:
    m = metrics()
    m.batch_requests.observe(requests)
    m.batch_texts.observe(stats.texts)
    m.batch_tokens.observe(stats.tokens)
    m.inference.observe(seconds)
    m.texts.inc(stats.texts)
    m.tokens.inc(stats.tokens)
    m.padded_tokens.inc(stats.padded_tokens)
    m.passes.inc(stats.passes)


def observe_queue_waits(sent_at: Iterable[Any], now: float | None = None) -> None:
    """Queue wait of each message that carries the API's publish time (clocks are NTP-synced;
    a negative skew counts as zero)."""
    now = time.time() if now is None else now
    histogram = metrics().queue_wait
    for sent in sent_at:
        if isinstance(sent, int | float):
            histogram.observe(max(0.0, now - sent))


def count_cache(lookups: int, hits: int) -> None:
    if lookups:
        metrics().cache_lookups.inc(lookups)
        metrics().cache_hits.inc(hits)


def count_tasks(outcome: str, n: int = 1) -> None:
    if n:
        metrics().tasks.labels(outcome).inc(n)


def count_failures(reason: str, n: int = 1) -> None:
    if n:
        metrics().failures.labels(reason).inc(n)
        metrics().tasks.labels("failed").inc(n)


# -- serving (main process) -----------------------------------------------------------------------

_own_dir: Path | None = None
_server: Any = None


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    """Choose the directory the processes write to, before the pool forks."""
    global _own_dir
    if get_settings().metrics_port == 0:
        return
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        # Files from an earlier run would be summed in: start empty (one worker per directory).
        for stale in Path(given).glob("*.db"):
            stale.unlink()
    else:
        _own_dir = Path(tempfile.mkdtemp(prefix="toxfleet-metrics-"))
        os.environ[MULTIPROC_ENV] = str(_own_dir)
    # prometheus_client reads the variable once, at import, and the `celery` command may have imported
    # it already (Flower's CLI plugin does): choose the value class again, before any metric exists.
    from prometheus_client import values  # after the variable is set: see the comment above

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    global _server
    port = get_settings().metrics_port
    if port == 0 or MULTIPROC_ENV not in os.environ:
        return
    # Not at module level: prometheus_client picks multiprocess mode when imported (module docstring).
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    metrics()  # this process's zeros: every series exists before the first batch (see WorkerMetrics)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    try:
        _server, _thread = start_http_server(port, registry=registry)
    except OSError as exc:
        # Scoring matters more than its metrics: keep working, say so loudly.
        logger.error("metrics: cannot serve on port %d (%s); set TOXFLEET_METRICS_PORT to a free port", port, exc)
        return
    logger.info("metrics: serving Prometheus metrics of all worker processes on :%d/metrics", port)


@signals.worker_process_shutdown.connect
def _on_process_shutdown(pid: int | None = None, **_: Any) -> None:
    if MULTIPROC_ENV in os.environ:
        from prometheus_client import multiprocess  # imported late for the same reason as above

        multiprocess.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    if _server is not None:
        _server.shutdown()
    if _own_dir is not None:
        shutil.rmtree(_own_dir, ignore_errors=True)
