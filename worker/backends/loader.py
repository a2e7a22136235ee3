"""Build a backend by name, in this process, from its entry in `worker.backends.registry`.

The name is already resolved: `auto` is decided above this, by `worker.gate.selection`, so that
loading a backend never depends on the gate. Nothing is exported or measured here: ONNX backends
load what `python -m worker.export` built and refuse, with the command to run, an export that is
missing, stale or corrupt.
"""

from __future__ import annotations

import time

from worker.backends import registry
from worker.backends.base import Backend
from worker.settings import WorkerSettings


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run on this machine, or None (`registry.unavailable`). ONNX backends:
    what they lack shows when they load."""
    return registry.unavailable(name)


def load_backend(name: str, settings: WorkerSettings) -> Backend:
    """Build backend `name` (a TOXFLEET_BACKEND value other than `auto`) for these settings."""
    started = time.perf_counter()
    spec = registry.spec(name)  # ValueError for `auto` and unknown names
    reason = registry.unavailable(name)  # before the model is loaded: a refusal should not cost a load
    if reason is not None:
        raise RuntimeError(f"TOXFLEET_BACKEND={name} cannot run here: {reason}")
    backend: Backend
    if spec.runtime == registry.ONNX:
        # No torch import on this path: an image without torch can run it.
        backend = registry.loader(name)(settings)
    else:
        import torch  # heavy, and absent from ONNX-only images: only on the torch backends' path

        from worker.weights import load_detoxify

        backend_class = registry.loader(name)  # the per-row module defines torch modules at import: imported now
        torch.set_num_threads(settings.torch_threads)
        backend = backend_class(load_detoxify(settings), settings.model_identity)
    backend.name, backend.precision = spec.name, spec.precision
    backend.load_seconds = time.perf_counter() - started
    return backend
