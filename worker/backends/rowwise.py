"""Detoxify's torch model with per-row int8 matmuls (`torch-int8-rowwise`).

Naive dynamic int8 (`torch-int8`) quantizes each activation tensor with ONE scale per call. Trained
transformers carry a few outlier channels and tokens, and in a padded pass one text's outlier token
then coarsens every other text's activations. This backend instead gives every activation ROW (one
token of one text) its own scale, and every weight output channel its own scale, and multiplies
int8 x int8 -> int32 with `torch._int_mm` (oneDNN VNNI kernels on x86). A text's scores then no
longer depend on which texts share its pass, and the error per token is that of its own largest
activation.

The output projections (the inputs with the largest outliers) stay in bf16 and the classifier in
fp32: `default_plan`, the only plan the loader uses. It does not pass the fidelity gate on trained
weights, so `auto` picks it only where the gate says so. The recipes it was chosen from (SmoothQuant,
a greedy search for layers to keep) live in `tools.int8_recipes`; the measurements, in
docs/history.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.backends.reduced import rowwise_unavailable
from worker.backends.torch import TorchBackend

INT8_MAX = 127
"""Symmetric int8 range [-127, 127]: -128 is never used, so negation is exact."""

KEEP_FP32_DEFAULT = ("classifier",)
"""Linear layers never quantized: the classifier (6 x hidden: no measurable cost, and its error would
reach the logits undamped)."""


@dataclass
class QuantPlan:
    """Which Linear layers (by module name) stay out of int8, and in which precision."""

    keep_fp32: list[str] = field(default_factory=lambda: list(KEEP_FP32_DEFAULT))
    keep_bf16: list[str] = field(default_factory=list)
    note: str = ""


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [out, in], fp32 scale [out])."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a 2-D activation: (int8 [rows, in], fp32 scale [rows, 1])."""
    scale = (x.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min_(1e-12)
    q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class RowwiseInt8Linear(torch.nn.Module):
    """y = x W^T + b with x quantized per row (token) at call time, W per output channel ahead of time,
    the product in int8 x int8 -> int32 (`torch._int_mm`), rescaled to fp32."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_weight(linear.weight.detach().float())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Stored [in, out] contiguous: oneDNN's int8 GEMM reads it faster than a transposed view of
        # [out, in] on the FFN shapes.
        self.register_buffer("weight_int8", q.t().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        q, row_scale = quantize_rows(rows)
        acc = torch._int_mm(q, self.weight_int8)
        y = acc.float().mul_(row_scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row x per-channel"


class Bf16Linear(torch.nn.Module):
    """A Linear computed in bf16 (weights stored in bf16), fp32 in and out."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      dtype=torch.bfloat16)
        with torch.no_grad():
            self.linear.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.linear.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x.to(torch.bfloat16)).float()
        return out


def linear_names(model: torch.nn.Module) -> list[str]:
    """Module names of every `torch.nn.Linear` in the model, in definition order."""
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where the submodule `name` was."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_plan(model: torch.nn.Module, plan: QuantPlan) -> torch.nn.Module:
    """Replace, in place, every Linear by its per-row int8 form, except those the plan keeps (fp32 as
    is, or bf16). Returns the model. Names in the plan that match no Linear are an error: a plan made
    for another architecture must not silently quantize everything."""
    names = linear_names(model)
    unknown = sorted((set(plan.keep_fp32) | set(plan.keep_bf16)) - set(names) - set(KEEP_FP32_DEFAULT))
    if unknown:
        raise ValueError(f"quantization plan names Linear layers this model lacks: {unknown[:5]}")
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, torch.nn.Linear)
        if name in plan.keep_fp32:
            continue
        if name in plan.keep_bf16:
            set_module(model, name, Bf16Linear(linear))
            continue
        set_module(model, name, RowwiseInt8Linear(linear))
    return model


def output_projections(names: Sequence[str]) -> list[str]:
    """The projections that write into the residual stream: BERT/RoBERTa `*.output.dense`, ALBERT
    `*.attention.dense` and `*.ffn_output`. Their inputs (attention context, GELU output) carry the
    largest outliers."""
    return [n for n in names if n.endswith("output.dense") or n.endswith("attention.dense")
            or n.endswith("ffn_output")]


def default_plan(model: torch.nn.Module) -> QuantPlan:
    """The backend's plan: the output projections in bf16, the classifier fp32, the rest int8."""
    return QuantPlan(keep_bf16=output_projections(linear_names(model)),
                     note="default: output projections in bf16")


class TorchRowwiseInt8Backend(TorchBackend):
    """The reference model with its Linear layers in per-row int8 (`RowwiseInt8Linear`), except what
    the plan keeps in bf16/fp32 (default: `default_plan`)."""

    @classmethod
    def unavailable(cls) -> str | None:
        return rowwise_unavailable()

    def __init__(self, detoxify: Any, identity: str, plan: QuantPlan | None = None) -> None:
        super().__init__(detoxify, identity)
        self.plan = plan or default_plan(self._model)
        apply_plan(self._model, self.plan)

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["quant_plan"] = {"keep_bf16": len(self.plan.keep_bf16), "keep_fp32": len(self.plan.keep_fp32),
                              "note": self.plan.note}
        return info
