"""toxfleet's inference tier: Celery workers that score batched requests with Detoxify.

`celery -A worker ...` finds the app as `worker.app`. It is imported lazily, so that the commands in
this package (`python -m worker.exports`, `python -m worker.gate`) and `worker.local` run without a
valid worker configuration and without connecting Celery's signal handlers.

Layers, top to bottom (every import points down):

    lifecycle.py       Celery signal wiring: imports the rest, imported by nothing (the app's `include`)
    tasks.py           the `toxfleet.score` task: validate, cache, score the batch, store per request
    batching.py        the batching task base (buffer, token budget, worker-loss retries)
    results.py, sweeper.py, heartbeat.py, metrics.py   what the worker writes to Redis and Prometheus
    state.py, local.py this process's scorer; the same for `toxfleet score --local`
    gate/              which backend `auto` runs: decision, fidelity measurements, selection, CLI
    scorer.py          length-sorted, padding-capped passes over any backend
    backends/          base contract, torch reference, reduced precision, ONNX Runtime, loader
    exports/           ahead-of-time ONNX artifacts (layout, verification) and their build, CLI
    settings.py, cpus.py, celery_app.py
"""

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        # PEP 562 lazy attribute, not a hidden dependency: building the app validates the worker settings,
        # which the commands and `worker.local` above must not need.
        from worker.celery_app import app

        return app
    raise AttributeError(name)
