"""Detoxify's torch model run in reduced precision: int8 dynamic quantization, or bf16 autocast
(compiled by TorchInductor: `worker.backends.compiled`).

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

from worker.backends.torch import TorchBackend
from worker.cpus import INT8_DOT_FLAGS, cpu_flags

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags that give bf16 matrix units (AMX) or instructions; without one, bf16 is emulated and far
slower than fp32 (docs/history.md has the figures)."""

def _needs_one_of(flags: tuple[str, ...], otherwise: str) -> str | None:
    """The refusal for a CPU with none of `flags` (read once from /proc/cpuinfo), or None."""
    if cpu_flags().isdisjoint(flags):
        return f"it needs a CPU with one of {', '.join(flags)}; {otherwise}"
    return None


def bf16_unavailable() -> str | None:
    """Why bf16 matmuls would be slower than fp32 on this CPU, or None."""
    return _needs_one_of(BF16_FLAGS, "this one would emulate bf16 slower than fp32")


def int8_dot_unavailable() -> str | None:
    """Why int8 x int8 matmuls would be slow or, in ONNX Runtime, saturate on this CPU, or None.
    `onnx-int8` still loads there (its export and loading do not depend on the CPU): the gate judges
    what saturation costs."""
    return _needs_one_of(INT8_DOT_FLAGS, "without int8 dot products its matmuls are far slower than fp32 "
                                         "(torch) or saturate (ONNX Runtime)")


def rowwise_unavailable() -> str | None:
    """`torch-int8-rowwise`'s answer (int8 `torch._int_mm`, projections kept in bf16). Here, not on its
    class: its module imports torch, and the loader and the gate ask before they load anything."""
    return int8_dot_unavailable() or bf16_unavailable()


class TorchInt8Backend(TorchBackend):
    """`torch.ao.quantization.quantize_dynamic` on every Linear: int8 weights, activations quantized
    per batch (one scale per tensor), fbgemm/oneDNN VNNI kernels where the CPU has them."""

    def __init__(self, detoxify: Any, identity: str) -> None:
        super().__init__(detoxify, identity)
        import torch  # heavy: imported when this backend is built, in the process that runs it

        with warnings.catch_warnings():
            # torch 2.13 deprecates torch.ao.quantization in favour of torchao (not a dependency here);
            # the eager dynamic path still works and is what this backend measures.
            warnings.simplefilter("ignore")
            self._model = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
                self._model, {torch.nn.Linear}, dtype=torch.qint8)


FP32_HEAD = ("pooler", "classifier")
"""Modules the bf16 backends keep in fp32 (where the model has them): the classification head and the
pooler before it (BERT, ALBERT). They turn the last hidden state into the logits, so their rounding
reaches the scores with nothing after it to average it out, and they are a fraction of a per cent
of a pass's FLOPs; keeping them in fp32 cut the gate's flips on the trained checkpoint (docs/history.md)."""


def fp32_head(model: Any) -> list[Any]:
    """Make `FP32_HEAD`'s modules of a Hugging Face classification model compute in fp32 under bf16
    autocast (inputs cast up, autocast off inside them); returns them."""
    import torch  # heavy, and absent from ONNX-only images: imported when a bf16 backend is built

    kept = []
    for owner in dict.fromkeys((model, model.base_model)):
        for name in FP32_HEAD:
            module = getattr(owner, name, None)
            if isinstance(module, torch.nn.Module):
                module.forward = _in_fp32(torch, module.forward)
                kept.append(module)
    return kept


def _in_fp32(torch: Any, forward: Any) -> Any:
    def fp32_forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_up(torch, a) for a in args)
        kwargs = {k: _up(torch, v) for k, v in kwargs.items()}
        with torch.autocast("cpu", enabled=False):
            return forward(*args, **kwargs)
    return fp32_forward


def _up(torch: Any, value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class TorchBf16Backend(TorchBackend):
    """The fp32 model under `torch.autocast("cpu", bfloat16)`: matrix products in bf16 (AMX tiles on
    CPUs that have them), reductions such as softmax and LayerNorm kept in fp32 by autocast, and the
    classification head in fp32 (`FP32_HEAD`)."""

    @classmethod
    def unavailable(cls) -> str | None:
        return bf16_unavailable()

    def __init__(self, detoxify: Any, identity: str) -> None:
        super().__init__(detoxify, identity)
        self._fp32_modules = fp32_head(self._model)

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        torch = self._torch
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self._model(**self.padded(batch))[0]
        probs = torch.sigmoid(logits[:, : len(self.labels)].float())
        out: list[list[float]] = probs.tolist()
        return out
