"""toxfleet's inference tier: Celery workers that score batched requests with Detoxify.

`celery -A worker ...` finds the app as `worker.app`. It is built lazily, so that the commands in
this package (`python -m worker.export`, `python -m worker.gate`) and `worker.local` never build
the Celery app.

Layers, top to bottom (every import points down; a line imports only from lines below it):

    lifecycle.py   Celery signal wiring (loaded by the app's `include`)      } entry points:
    export.py      `python -m worker.export`: build the export, then gate it } nothing imports
    local.py       `toxfleet score --local`: the worker's scorer in-process  } them
    tasks.py       the `toxfleet.score` task: validate, cache, score the batch, store per request
    state.py       this pool process's scorer: resolve `auto`, load the backend, wrap it
    gate/          which backend `auto` may run: decision, fidelity, selection, `python -m worker.gate`
    metrics.py     Prometheus metrics; heartbeat.py, sweeper.py, results.py: what the worker keeps in Redis
    batching.py    the batching task base; celery_app.py: the app
    scorer.py      length-sorted, padding-capped passes over any backend
    backends/      the Backend contract, torch reference, reduced precision, ONNX Runtime, loader
    onnx_export/   ahead-of-time ONNX artifacts: layout and verification, build
    weights.py     where a checkpoint's weights come from; settings.py, cpus.py
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
