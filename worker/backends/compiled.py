"""Detoxify's torch model compiled by TorchInductor (`torch.compile`): in fp32, or in bf16.

Compiling changes how the model computes, not what: the elementwise work between the matrix products
(GELU, the attention mask, residual adds, LayerNorm) is fused into generated C++ kernels and the
frozen weights are prepacked for oneDNN, so the per-op dispatch that dominates a small model's eager
pass is gone. fp32 keeps fp32 arithmetic (only summation order differs, so the FP32 budget applies);
bf16 adds `worker.backends.reduced`'s autocast.

The price is paid at process start: tracing and building the kernels takes tens of seconds per
process (the warm-up passes of `WARM_UP_BATCHES`), less where TorchInductor's on-disk cache already
holds them, and a C++ compiler on the worker (refused without one).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from worker.backends.reduced import TorchBf16Backend
from worker.backends.torch import TorchBackend

COMPILER_ENV = "CXX"
"""Where TorchInductor looks for its C++ compiler first; then `c++`, `g++` on PATH."""

WARM_UP_BATCHES = (1, 2)
"""Texts in the passes a compiled backend runs at load: TorchInductor compiles one graph for a single
text (it specialises a dimension of size 1) and one for every larger batch, whatever its length
(dynamic shapes), so after these two no job waits for a compile."""

INDUCTOR_OPTIONS = {"freezing": True, "compile_threads": 1}
"""TorchInductor options for these backends' compile only (not the process-wide config). Freezing
folds the weights into the graph as constants, which is what lets oneDNN prepack them; one compile
thread because a pool process owns one core, and compile workers would be children of a daemonic
process."""


def cxx_compiler() -> str | None:
    """The C++ compiler TorchInductor would build its CPU kernels with, or None."""
    return os.environ.get(COMPILER_ENV) or shutil.which("c++") or shutil.which("g++")


class TorchCompiledBackend(TorchBackend):
    """The reference model, fp32, traced by `torch.compile` with dynamic shapes and frozen weights."""

    @classmethod
    def unavailable(cls) -> str | None:
        if cxx_compiler() is None:
            return f"it needs a C++ compiler for TorchInductor's kernels (set {COMPILER_ENV}, or install g++)"
        return super().unavailable()

    def __init__(self, detoxify: Any, identity: str) -> None:
        super().__init__(detoxify, identity)
        self._prepare_weights()
        self._model = self._torch.compile(self._model, dynamic=True, options=INDUCTOR_OPTIONS)
        special = self.tokenize([""])[0]
        for texts in WARM_UP_BATCHES:
            self.predict([special] * texts)

    def _prepare_weights(self) -> None:
        """Change the weights before they are frozen into the graph: nothing, in fp32."""


class TorchBf16CompiledBackend(TorchCompiledBackend, TorchBf16Backend):
    """`torch-bf16`, compiled: the Linear weights outside its fp32 head stored in bf16 once (autocast
    re-casts fp32 weights on every call, and would cast these to the same values), then compiled as
    `torch-compiled` is, so predictions run under `torch-bf16`'s autocast and it needs both a compiler
    and bf16 units."""

    def _prepare_weights(self) -> None:
        torch = self._torch
        kept = {id(m) for head in self._fp32_modules for m in head.modules()}
        for module in self._model.modules():
            if isinstance(module, torch.nn.Linear) and id(module) not in kept:
                module.to(torch.bfloat16)
