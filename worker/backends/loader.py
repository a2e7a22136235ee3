"""Build a backend by name, in this process.

The name is already resolved: `auto` is decided above this, by `worker.gate.selection`, so that
loading a backend never depends on the gate. Nothing is exported or measured here: ONNX backends
load what `python -m worker.export` built and refuse, with the command to run, an export that is
missing, stale or corrupt.
"""

from __future__ import annotations

import time

from worker.backends.base import Backend
from worker.backends.compiled import TorchBf16CompiledBackend, TorchCompiledBackend
from worker.backends.onnx import load_onnx_backend
from worker.backends.reduced import TorchBf16Backend, TorchInt8Backend, rowwise_unavailable
from worker.backends.torch import TorchBackend
from worker.settings import WorkerSettings
from worker.weights import load_detoxify

TORCH_BACKENDS: dict[str, type[TorchBackend]] = {
    "torch": TorchBackend, "torch-compiled": TorchCompiledBackend, "torch-int8": TorchInt8Backend,
    "torch-bf16": TorchBf16Backend, "torch-bf16-compiled": TorchBf16CompiledBackend}
"""Backends built on the model Detoxify loads."""

ROWWISE = "torch-int8-rowwise"
"""Per-row int8 (`worker.backends.rowwise`): built on Detoxify's model too, imported only when chosen."""


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run on this machine, or None (ONNX backends: always None here; what
    they lack shows when they load, and `onnx-int8`'s saturation without int8 dot products, in the
    gate: `worker.backends.reduced.INT8_DOT_FLAGS`)."""
    if name == ROWWISE:
        return rowwise_unavailable()
    backend_class = TORCH_BACKENDS.get(name)
    return None if backend_class is None else backend_class.unavailable()


def load_backend(name: str, settings: WorkerSettings) -> Backend:
    """Build backend `name` (a TOXFLEET_BACKEND value other than `auto`) for these settings."""
    started = time.perf_counter()
    backend: Backend
    if name in ("onnx", "onnx-int8"):
        # No torch import on this path: an image without torch can run it.
        backend = load_onnx_backend(settings, int8=name == "onnx-int8")
    elif name in TORCH_BACKENDS:
        import torch  # heavy, and absent from ONNX-only images: only on the torch backends' path

        backend_class = TORCH_BACKENDS[name]
        backend_class.require()  # before the model is loaded: a refusal should not cost a load
        torch.set_num_threads(settings.torch_threads)
        backend = backend_class(load_detoxify(settings), settings.model_identity)
    elif name == ROWWISE:
        import torch  # heavy, and absent from ONNX-only images: only on the torch backends' path

        # Its module defines torch.nn.Module classes at import (so imports torch): only on its own path.
        from worker.backends.rowwise import TorchRowwiseInt8Backend

        TorchRowwiseInt8Backend.require()  # before the model is loaded, as above
        torch.set_num_threads(settings.torch_threads)
        backend = TorchRowwiseInt8Backend(load_detoxify(settings), settings.model_identity)
    elif name == "auto":
        raise ValueError("TOXFLEET_BACKEND=auto must be resolved first (worker.gate.selection.resolve_backend)")
    else:
        raise ValueError(f"unknown TOXFLEET_BACKEND={name!r}")
    backend.load_seconds = time.perf_counter() - started
    return backend
