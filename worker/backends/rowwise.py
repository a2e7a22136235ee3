"""Detoxify's torch model with per-row int8 matmuls: the best int8 recipe measured on trained weights.

Naive dynamic int8 (`torch-int8`, `onnx-int8`) quantizes each activation tensor with ONE scale per
call. Trained transformers carry a few outlier channels and tokens, and in a padded pass one text's
outlier token then coarsens every other text's activations: on the trained test checkpoint
(`tools.trained`) that misses the gate by an order of magnitude. This backend instead gives every
activation ROW (one token of one text) its own scale, and every weight output channel its own scale,
and multiplies int8 x int8 -> int32 with `torch._int_mm` (oneDNN VNNI kernels on x86). A text's
scores then no longer depend on which texts share its pass, and the error per token is that of its
own largest activation.

**It does not yet pass the issue-10 gate on the trained checkpoint** (`tools.trained`, 1,024 texts,
many near thresholds): every Linear int8 gives max 0.08, p99 0.016, 1.7 % flips. The output projections
kept in fp32 give max 0.044, p99 0.012, 1.4 % flips. The rest of the error is in the QKV and FFN-in
matmuls (LayerNorm-output outlier channels). SmoothQuant (`smooth_scale`, `QuantPlan.smooth_alpha`,
calibrated by `activation_maxima`; measured in `tools.int8_bench`) narrows it but does not close it
either (docs/int8-recipes.md). `auto` must gate it like any reduced backend.

Projections can be kept in bf16 (or fp32). Which ones is a `QuantPlan`: a default
rule, or one found by `search_plan` (greedy: keep the most sensitive Linear in higher precision until
the gate holds), stored as JSON next to an export and passed in by the loader.

Measurements and reasoning: docs/int8-recipes.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.backends.reduced import rowwise_unavailable
from worker.backends.torch import TorchBackend

INT8_MAX = 127
"""Symmetric int8 range [-127, 127]: -128 is never used, so negation is exact."""

KEEP_FP32_DEFAULT = ("classifier",)
"""Linear layers never quantized: the classifier (6 x hidden: no measurable cost, and its error would
reach the logits undamped)."""

QUANT_THREADS_NOTE = "torch._int_mm on CPU uses oneDNN (AVX512-VNNI / AMX where present)"


@dataclass
class QuantPlan:
    """Which Linear layers (by module name) stay out of int8, and in which precision."""

    keep_fp32: list[str] = field(default_factory=lambda: list(KEEP_FP32_DEFAULT))
    keep_bf16: list[str] = field(default_factory=list)
    note: str = ""
    smooth_alpha: float | None = None
    """SmoothQuant migration strength for the int8 layers (None: no smoothing)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        data = json.loads(text)
        alpha = data.get("smooth_alpha")
        return cls(keep_fp32=list(data.get("keep_fp32", [])), keep_bf16=list(data.get("keep_bf16", [])),
                   note=str(data.get("note", "")), smooth_alpha=None if alpha is None else float(alpha))

    @classmethod
    def load(cls, path: Path) -> QuantPlan:
        return cls.from_json(path.read_text())


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


def smooth_scale(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (Xiao et al.,
    2023): x / s and W * s give the same product, with the activation's outlier channels moved into
    the weight columns, which are quantized per output channel anyway."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    s = act_max.float().clamp_min(1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp_min(1e-5)


class RowwiseInt8Linear(torch.nn.Module):
    """y = x W^T + b with x quantized per row (token) at call time, W per output channel ahead of time,
    the product in int8 x int8 -> int32 (`torch._int_mm`), rescaled to fp32. With `smooth` (one
    factor per input channel, `smooth_scale`), x / smooth is quantized against W * smooth."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    inv_smooth: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        if smooth is not None:
            weight = weight * smooth[None, :]
        q, scale = quantize_weight(weight)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Stored [in, out] contiguous: oneDNN's int8 GEMM reads it ~20 % faster than a transposed
        # view of [out, in] on the FFN shapes (measured, 1 thread, Zen 4).
        self.register_buffer("weight_int8", q.t().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.register_buffer("inv_smooth", None if smooth is None else (1.0 / smooth.float()).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if self.inv_smooth is not None:
            rows = rows * self.inv_smooth
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


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def activation_maxima(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
                      ) -> dict[str, torch.Tensor]:
    """Per Linear (by module name), the largest |x_j| of each input channel j over the calibration
    `batches` (padded `input_ids`/`attention_mask` dicts), with the model in fp32: SmoothQuant's
    calibration. A Linear called several times (ALBERT's shared layer) keeps the max over every call."""
    maxima: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
            x = inputs[0].detach().float()
            m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
            maxima[name] = m if name not in maxima else torch.maximum(maxima[name], m)
        return record

    for name in linear_names(model):
        handles.append(model.get_submodule(name).register_forward_hook(hook(name)))
    try:
        with torch.inference_mode():
            for batch in batches:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    return {name: m.clone() for name, m in maxima.items()}


def apply_plan(model: torch.nn.Module, plan: QuantPlan,
               act_max: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Replace, in place, every Linear by its per-row int8 form, except those the plan keeps (fp32 as
    is, or bf16). Returns the model. Names in the plan that match no Linear are an error: a plan made
    for another architecture must not silently quantize everything. With `plan.smooth_alpha`, each
    int8 Linear gets SmoothQuant factors from `act_max` (`activation_maxima`), which is then required."""
    names = linear_names(model)
    unknown = sorted((set(plan.keep_fp32) | set(plan.keep_bf16)) - set(names) - set(KEEP_FP32_DEFAULT))
    if unknown:
        raise ValueError(f"quantization plan names Linear layers this model lacks: {unknown[:5]}")
    if plan.smooth_alpha is not None and act_max is None:
        raise ValueError("a SmoothQuant plan needs the calibration maxima (activation_maxima)")
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, torch.nn.Linear)
        if name in plan.keep_fp32:
            continue
        if name in plan.keep_bf16:
            _set_module(model, name, Bf16Linear(linear))
            continue
        smooth = None
        if plan.smooth_alpha is not None and act_max is not None and name in act_max:
            smooth = smooth_scale(act_max[name], linear.weight, plan.smooth_alpha)
        _set_module(model, name, RowwiseInt8Linear(linear, smooth))
    return model


def output_projections(names: Sequence[str]) -> list[str]:
    """The projections that write into the residual stream: BERT/RoBERTa `*.output.dense`, ALBERT
    `*.attention.dense` and `*.ffn_output`. Their inputs (attention context, GELU output) carry the
    largest outliers."""
    return [n for n in names if n.endswith("output.dense") or n.endswith("attention.dense")
            or n.endswith("ffn_output")]


def default_plan(model: torch.nn.Module) -> QuantPlan:
    """The rule used without a searched plan: the output projections in bf16, the rest int8."""
    return QuantPlan(keep_bf16=output_projections(linear_names(model)),
                     note="default: output projections in bf16")


def search_plan(model: torch.nn.Module, passes_of: Callable[[torch.nn.Module], list[list[float]]],
                reference: Sequence[Sequence[float]], passes: Callable[[Sequence[Sequence[float]],
                                                                        Sequence[Sequence[float]]], bool],
                keep: str = "bf16", candidates: Sequence[str] | None = None, max_kept: int | None = None
                ) -> tuple[QuantPlan, list[dict[str, Any]]]:
    """Greedy mixed precision: rank the Linear layers by the error each alone makes when quantized,
    then keep the worst ones in `keep` precision, one more at a time, until `passes(reference, scores)`.

    `passes_of(model)` scores the gate texts (in worker-like passes) with a model; the model given is
    never modified (copies are). Returns the plan and the search's trace (layers kept, error)."""
    import copy

    names = [n for n in (candidates or linear_names(model)) if n not in KEEP_FP32_DEFAULT]

    def error(scores: Sequence[Sequence[float]]) -> float:
        return max(abs(a - b) for ra, rb in zip(reference, scores, strict=True) for a, b in zip(ra, rb, strict=True))

    sensitivity: dict[str, float] = {}
    for name in names:
        trial = copy.deepcopy(model)
        _set_module(trial, name, RowwiseInt8Linear(trial.get_submodule(name)))  # type: ignore[arg-type]
        sensitivity[name] = error(passes_of(trial))
    ranked = sorted(names, key=lambda n: -sensitivity[n])
    trace: list[dict[str, Any]] = []
    limit = len(ranked) if max_kept is None else min(max_kept, len(ranked))
    for kept in range(limit + 1):
        held = ranked[:kept]
        plan = QuantPlan(keep_fp32=list(KEEP_FP32_DEFAULT) + (held if keep == "fp32" else []),
                         keep_bf16=held if keep == "bf16" else [],
                         note=f"greedy search: {kept} most sensitive Linear kept in {keep}")
        scores = passes_of(apply_plan(copy.deepcopy(model), plan))
        ok = passes(reference, scores)
        trace.append({"kept": held, "max_abs": error(scores), "passed": ok})
        if ok:
            return plan, trace
    raise RuntimeError(f"no plan with at most {limit} layers kept passes the gate")


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
