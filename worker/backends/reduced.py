"""Detoxify's torch model run in reduced precision: int8 dynamic quantization, or bf16 autocast
(eager, or compiled by TorchInductor).

Both start from exactly the model the reference loads and change only how it computes, so the
tokenizer, label order and output are the reference's. Neither is exported ahead of time: dynamic
quantization of the Linear layers is a deterministic function of the checkpoint that takes about a
second at process start, and autocast changes nothing stored. Both must pass the fidelity gate
(`worker.gate.fidelity`) before `auto` may pick them.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

from worker.backends.base import REDUCED
from worker.backends.torch import TorchBackend
from worker.cpus import cpu_flags

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags that give bf16 matrix units (AMX) or instructions; without one, bf16 is emulated and slow."""


class TorchInt8Backend(TorchBackend):
    """`torch.ao.quantization.quantize_dynamic` on every Linear: int8 weights, activations quantized
    per batch (one scale per tensor), fbgemm/oneDNN VNNI kernels where the CPU has them."""

    name = "torch-int8"
    precision = REDUCED

    def __init__(self, detoxify: Any, identity: str) -> None:
        super().__init__(detoxify, identity)
        import torch  # heavy: imported when this backend is built, in the process that runs it

        with warnings.catch_warnings():
            # torch 2.13 deprecates torch.ao.quantization in favour of torchao (not a dependency here);
            # the eager dynamic path still works and is what this backend measures.
            warnings.simplefilter("ignore")
            self._model = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
                self._model, {torch.nn.Linear}, dtype=torch.qint8)


class TorchBf16Backend(TorchBackend):
    """The fp32 model under `torch.autocast("cpu", bfloat16)`: matrix products in bf16 (AMX tiles on
    CPUs that have them), reductions such as softmax and LayerNorm kept in fp32 by autocast."""

    name = "torch-bf16"
    precision = REDUCED

    @classmethod
    def unavailable(cls) -> str | None:
        if not any(flag in cpu_flags() for flag in BF16_FLAGS):
            return f"it needs a CPU with one of {', '.join(BF16_FLAGS)}; this one would emulate bf16 slower than fp32"
        return None

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        torch = self._torch
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self._model(**self.padded(batch))[0]
        probs = torch.sigmoid(logits[:, : len(self.labels)].float())
        out: list[list[float]] = probs.tolist()
        return out


COMPILER_ENV = "CXX"
"""Where TorchInductor looks for its C++ compiler first; then `c++`, `g++` on PATH."""

WARM_UP_BATCHES = (1, 2)
"""Texts in the passes `TorchBf16CompiledBackend` runs at load: TorchInductor compiles one graph for a
single text (it specialises a dimension of size 1) and one for every larger batch, whatever its
length (dynamic shapes), so after these two no job waits for a compile."""


def cxx_compiler() -> str | None:
    """The C++ compiler TorchInductor would build its CPU kernels with, or None."""
    return os.environ.get(COMPILER_ENV) or shutil.which("c++") or shutil.which("g++")


class TorchBf16CompiledBackend(TorchBf16Backend):
    """`torch-bf16`, compiled: the Linear weights stored in bf16 once (autocast re-casts fp32 weights
    on every call, and would cast these to the same values), the model traced by `torch.compile` with
    dynamic shapes and frozen weights, so TorchInductor fuses the elementwise work between the matrix
    products and prepacks the weights for oneDNN. Compiling takes ~25 s per process at load (warm-up
    passes of `WARM_UP_BATCHES`), and needs a C++ compiler on the worker (refused without one)."""

    name = "torch-bf16-compiled"

    @classmethod
    def unavailable(cls) -> str | None:
        if cxx_compiler() is None:
            return f"it needs a C++ compiler for TorchInductor's kernels (set {COMPILER_ENV}, or install g++)"
        return super().unavailable()

    def __init__(self, detoxify: Any, identity: str) -> None:
        super().__init__(detoxify, identity)
        torch = self._torch
        import torch._inductor.config as inductor  # heavy: only where this backend is built

        # Freezing folds the weights into the graph as constants: what lets oneDNN prepack them.
        inductor.freezing = True
        # One compile process: a pool process owns one core, and compile workers would be children of
        # a daemonic process.
        inductor.compile_threads = 1
        for module in self._model.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(torch.bfloat16)
        self._model = torch.compile(self._model, dynamic=True)
        special = self.tokenize([""])[0]
        for texts in WARM_UP_BATCHES:
            self.predict([special] * texts)
