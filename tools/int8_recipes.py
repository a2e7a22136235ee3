"""Research recipes on top of `worker.backends.rowwise`, measured by `tools.int8_bench` and shipped by
no backend: SmoothQuant for the torch per-row int8 Linear, and a greedy search for the layers to keep
in higher precision. Results and reasoning: docs/history.md (the int8 recipes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.backends.rowwise import (
    KEEP_FP32_DEFAULT,
    QuantPlan,
    RowwiseInt8Linear,
    apply_plan,
    linear_names,
    set_module,
)


def smooth_scale(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (Xiao et al.,
    2023): x / s and W * s give the same product, with the activation's outlier channels moved into
    the weight columns, which are quantized per output channel anyway."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    s = act_max.float().clamp_min(1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp_min(1e-5)


class SmoothedInt8Linear(torch.nn.Module):
    """A `RowwiseInt8Linear` of W * smooth, fed x / smooth (one factor per input channel)."""

    inv_smooth: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor) -> None:
        super().__init__()
        scaled = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            scaled.weight.copy_(linear.weight.detach().float() * smooth[None, :])
            if linear.bias is not None:
                scaled.bias.copy_(linear.bias)
        self.int8 = RowwiseInt8Linear(scaled)
        self.register_buffer("inv_smooth", (1.0 / smooth.float()).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.int8(x.float() * self.inv_smooth)
        return out


def linear_input_maxima(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
                        ) -> dict[str, torch.Tensor]:
    """Per Linear (by module name), the largest |x_j| of each input channel j over the calibration
    `batches` (padded `input_ids`/`attention_mask` dicts), with the model in fp32: SmoothQuant's
    calibration. A Linear called several times (ALBERT's shared layer) keeps the max over every call.
    (The ONNX export's counterpart is `worker.onnx_export.int8_graph.activation_maxima`.)"""
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


def apply_smoothed_plan(model: torch.nn.Module, plan: QuantPlan, alpha: float,
                        act_max: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`apply_plan`, with SmoothQuant (strength `alpha`, calibration `act_max` from
    `linear_input_maxima`) on every int8 Linear that was calibrated."""
    kept = set(plan.keep_fp32) | set(plan.keep_bf16)
    smoothed: dict[str, torch.nn.Module] = {}
    for name in linear_names(model):
        linear = model.get_submodule(name)
        if name not in kept and name in act_max:
            assert isinstance(linear, torch.nn.Linear)
            smoothed[name] = SmoothedInt8Linear(linear, smooth_scale(act_max[name], linear.weight, alpha))
    apply_plan(model, plan)
    for name, module in smoothed.items():
        set_module(model, name, module)
    return model


def search_plan(model: torch.nn.Module, passes_of: Callable[[torch.nn.Module], list[list[float]]],
                reference: Sequence[Sequence[float]], passes: Callable[[Sequence[Sequence[float]],
                                                                        Sequence[Sequence[float]]], bool],
                keep: str = "bf16", candidates: Sequence[str] | None = None, max_kept: int | None = None
                ) -> tuple[QuantPlan, list[dict[str, Any]]]:
    """Greedy mixed precision: rank the Linear layers by the error each alone makes when quantized,
    then keep the worst ones in `keep` precision, one more at a time, until `passes(reference, scores)`.

    `passes_of(model)` scores the gate texts (in worker-like passes) with a model; the model given is
    never modified (copies are). Returns the plan and the search's trace (layers kept, error)."""
    names = [n for n in (candidates or linear_names(model)) if n not in KEEP_FP32_DEFAULT]

    def error(scores: Sequence[Sequence[float]]) -> float:
        return max(abs(a - b) for ra, rb in zip(reference, scores, strict=True) for a, b in zip(ra, rb, strict=True))

    sensitivity: dict[str, float] = {}
    for name in names:
        trial = copy.deepcopy(model)
        set_module(trial, name, RowwiseInt8Linear(trial.get_submodule(name)))  # type: ignore[arg-type]
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
