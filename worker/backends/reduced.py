"""Detoxify's torch model run in reduced precision: int8 dynamic quantization, or bf16 autocast.

Both start from exactly the model the reference loads and change only how it computes, so the
tokenizer, label order and output are the reference's. Neither is exported ahead of time: dynamic
quantization of the Linear layers is a deterministic function of the checkpoint that takes about a
second at process start, and autocast changes nothing stored. Both must pass the fidelity gate
(`worker.gate.fidelity`) before `auto` may pick them.
"""

from __future__ import annotations

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

    def __init__(self, detoxify: Any, identity: str) -> None:
        missing = not any(flag in cpu_flags() for flag in BF16_FLAGS)
        if missing:
            raise RuntimeError(f"TOXFLEET_BACKEND=torch-bf16 needs a CPU with one of {', '.join(BF16_FLAGS)}; "
                               "this one would emulate bf16 slower than fp32")
        super().__init__(detoxify, identity)

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        torch = self._torch
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self._model(**self.padded(batch))[0]
        probs = torch.sigmoid(logits[:, : len(self.labels)].float())
        out: list[list[float]] = probs.tolist()
        return out
