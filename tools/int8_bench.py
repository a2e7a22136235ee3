"""Measure int8-class recipes against the gate budgets, and their speed, on a Detoxify checkpoint.

Every variant scores the same texts in worker-like padded passes (`worker.scorer.plan_passes`: sorted
by length, at most 16 texts / 1024 padded tokens a pass) and is compared with the torch fp32 model
scoring each text alone (no padding). Gate row: max and p99 absolute probability difference, texts
with any label flipped at 0.5 (and the worst over thresholds 0.1..0.9), the lowest per-label Spearman.
Speed: texts/s of one process on one torch thread, same passes, median of repeats.

    python -m tools.int8_bench --checkpoint models/trained/model.ckpt --hf models/trained/hf
    python -m tools.int8_bench --checkpoint models/unbiased-small/model.ckpt --hf models/unbiased-small/hf --speed-only
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.int8_measure import (
    Runner,
    bf16_context,
    flops,
    gate_passes,
    gate_row,
    kernel_ceiling,
    load,
    no_context,
    one_by_one,
    speed_row,
)
from tools.int8_onnx import OrtModel, onnx_fp32, onnx_role_search, onnx_variants
from tools.int8_recipes import apply_smoothed_plan, linear_input_maxima, search_plan
from worker.backends.rowwise import (
    KEEP_FP32_DEFAULT,
    QuantPlan,
    apply_plan,
    linear_names,
    output_projections,
)
from worker.calibration import calibration_texts
from worker.gate.probes import probe_texts
from worker.onnx_export import int8_graph as onnx_rowwise


def variants(model: Any, calibration: Callable[[], dict[str, torch.Tensor]]
             ) -> dict[str, Callable[[], tuple[Any, Callable[[], Any]]]]:
    """Every recipe, by name: a builder returning (model, precision context). `calibration()` gives
    SmoothQuant's per-channel activation maxima (computed once, on `worker.calibration` texts)."""
    names = linear_names(model)
    outputs = output_projections(names)

    def smooth(alpha: float, keep_bf16: Sequence[str] = ()) -> Callable[[], tuple[Any, Callable[[], Any]]]:
        def make() -> tuple[Any, Callable[[], Any]]:
            plan = QuantPlan(keep_bf16=list(keep_bf16))
            return apply_smoothed_plan(copy.deepcopy(model), plan, alpha, calibration()), no_context
        return make

    def fp32() -> tuple[Any, Callable[[], Any]]:
        return model, no_context

    def bf16() -> tuple[Any, Callable[[], Any]]:
        return model, bf16_context

    def dynamic_per_tensor() -> tuple[Any, Callable[[], Any]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
                copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
        return m, no_context

    def torchao_rowwise() -> tuple[Any, Callable[[], Any]]:
        # why: torchao is not a dependency; only this variant needs it
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        m = copy.deepcopy(model)
        quantize_(m, Int8DynamicActivationInt8WeightConfig(),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn not in KEEP_FP32_DEFAULT)
        return m, no_context

    def rowwise_all() -> tuple[Any, Callable[[], Any]]:
        return apply_plan(copy.deepcopy(model), QuantPlan()), no_context

    def rowwise_out_fp32() -> tuple[Any, Callable[[], Any]]:
        return apply_plan(copy.deepcopy(model), QuantPlan(keep_fp32=[*KEEP_FP32_DEFAULT, *outputs])), no_context

    def rowwise_out_bf16() -> tuple[Any, Callable[[], Any]]:
        return apply_plan(copy.deepcopy(model), QuantPlan(keep_bf16=outputs)), no_context

    def rowwise_ffn_out_bf16() -> tuple[Any, Callable[[], Any]]:
        ffn = [n for n in outputs if ".attention." not in n]
        return apply_plan(copy.deepcopy(model), QuantPlan(keep_bf16=ffn)), no_context

    return {"torch fp32": fp32, "torch-bf16 (autocast)": bf16,
            "dynamic int8, per-tensor (torch-int8)": dynamic_per_tensor,
            "torchao int8 dyn per-token x per-channel": torchao_rowwise,
            "rowwise int8 (_int_mm), every Linear": rowwise_all,
            "rowwise int8, *output* proj fp32": rowwise_out_fp32,
            "rowwise int8, *output* proj bf16": rowwise_out_bf16,
            "rowwise int8, FFN-output proj bf16": rowwise_ffn_out_bf16,
            "rowwise int8 + SmoothQuant a=0.5, every Linear": smooth(0.5),
            "rowwise int8 + SmoothQuant a=0.65, every Linear": smooth(0.65),
            "rowwise int8 + SmoothQuant a=0.8, every Linear": smooth(0.8),
            "rowwise int8 + SmoothQuant a=0.5, output proj bf16": smooth(0.5, outputs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("models/trained/model.ckpt"))
    parser.add_argument("--hf", type=Path, default=Path("models/trained/hf"))
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--speed-texts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--gate-only", action="store_true", help="fidelity triage: skip the timing")
    parser.add_argument("--only", default="", help="substrings of variant names to run, separated by commas "
                        "(or by | when a name holds a comma)")
    parser.add_argument("--search", action="store_true", help="also run the greedy mixed-precision search")
    parser.add_argument("--search-texts", type=int, default=256,
                        help="gate texts the greedy search ranks and tries plans on (the plan found is then "
                             "judged on every gate text)")
    parser.add_argument("--search-max-kept", type=int, default=None)
    parser.add_argument("--onnx-search", metavar="ALPHA", help="also run the greedy search over ONNX MatMul roles "
                        "kept fp32, per-row int8 with SmoothQuant ALPHA (or 'none')")
    parser.add_argument("--gate-threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, help="where the cached reference scores and the ONNX variants' "
                        "graphs go (default: next to the checkpoint)")
    parser.add_argument("--calibration-texts", type=int, default=128,
                        help="SmoothQuant calibration texts (worker.calibration: not the gate's or the bench's)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--scores-dir", type=Path, help="write each variant's gate scores here (JSON)")
    parser.add_argument("--ceiling", action="store_true", help="print the kernels' measured ceiling and exit")
    args = parser.parse_args(argv)

    if args.ceiling:
        torch.set_num_threads(1)
        for shape in ((1024, 768, 3072), (1024, 384, 1536)):
            print(shape, {k: round(v, 1) for k, v in kernel_ceiling(*shape).items()}, "Gop/s (1 thread)")
        return 0

    model, tokenizer, labels = load(args.checkpoint, args.hf)
    texts = probe_texts(args.texts)
    ids = tokenizer(texts, truncation=True, max_length=512)["input_ids"]
    gate = Runner(tokenizer, ids, len(labels))
    speed_ids = probe_texts(args.speed_texts, seed=11)
    speed = Runner(tokenizer, tokenizer(speed_ids, truncation=True, max_length=512)["input_ids"], len(labels))
    lin_flops, att_flops = flops(model, speed.batches)
    print(f"gate: {len(ids)} texts, {len(gate.passes)} passes, {gate.padded_tokens()} padded tokens; "
          f"speed: {len(speed.ids)} texts, {len(speed.passes)} passes, {speed.padded_tokens()} padded tokens, "
          f"{lin_flops / 1e9:.1f} GFLOP in Linear + {att_flops / 1e9:.1f} GFLOP attention", flush=True)

    reference: list[list[float]] | None = None
    if not args.speed_only:
        torch.set_num_threads(args.gate_threads)
        cache = (args.work_dir or args.checkpoint.parent) / f"reference-{len(ids)}.json"
        cache.parent.mkdir(parents=True, exist_ok=True)
        if cache.exists() and cache.stat().st_mtime > args.checkpoint.stat().st_mtime:
            reference = json.loads(cache.read_text())
        else:
            started = time.perf_counter()
            reference = one_by_one(model, tokenizer, ids, len(labels))
            cache.write_text(json.dumps(reference))
            print(f"reference (fp32, one text a pass): {time.perf_counter() - started:.1f} s", flush=True)
        flat = np.asarray(reference)
        print(f"reference band 0.1-0.9: {np.mean((flat >= 0.1) & (flat <= 0.9)):.3f}, "
              f"texts with a label >= 0.5: {np.mean(np.any(flat >= 0.5, axis=1)):.3f}, "
              f"texts with a label in 0.3-0.7: {np.mean(np.any((flat >= 0.3) & (flat <= 0.7), axis=1)):.3f}",
              flush=True)

    maxima: dict[str, torch.Tensor] = {}

    def calibration() -> dict[str, torch.Tensor]:
        if not maxima:
            texts = calibration_texts(args.calibration_texts)
            cal = Runner(tokenizer, tokenizer(texts, truncation=True, max_length=512)["input_ids"], len(labels))
            started = time.perf_counter()
            maxima.update(linear_input_maxima(model, cal.batches))
            print(f"calibration: {len(texts)} texts, {len(cal.batches)} passes, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        return maxima

    def feeds() -> list[dict[str, np.ndarray]]:
        texts = calibration_texts(args.calibration_texts)
        cal = Runner(tokenizer, tokenizer(texts, truncation=True, max_length=512)["input_ids"], len(labels))
        return [{"input_ids": b["input_ids"].numpy(), "attention_mask": b["attention_mask"].numpy()}
                for b in cal.batches]

    recipes = variants(model, calibration)
    onnx_dir = (args.work_dir or args.checkpoint.parent) / "int8-bench-onnx"
    recipes.update(onnx_variants(model, tokenizer, onnx_dir, feeds))
    results = []
    only = [s for s in args.only.split("|" if "|" in args.only else ",") if s]
    for name, make in recipes.items():
        if only and not any(s in name for s in only):
            continue
        try:
            m, context = make()
        except Exception as exc:  # a recipe that does not run here is a result too
            print(f"{name}: FAILED TO BUILD: {exc!r}", flush=True)
            results.append({"variant": name, "error": repr(exc)})
            continue
        row: dict[str, Any] = {"variant": name}
        if reference is not None:
            torch.set_num_threads(args.gate_threads)
            scores = gate.score(m, context)
            row.update(gate_row(reference, scores))
            if args.scores_dir:
                args.scores_dir.mkdir(parents=True, exist_ok=True)
                dump = {"variant": name, "scores": scores}
                (args.scores_dir / f"{len(results):02d}.json").write_text(json.dumps(dump))
        if not args.gate_only:
            torch.set_num_threads(1)
            row.update(speed_row(speed, m, context, args.repeats, lin_flops, att_flops))
        results.append(row)
        print(json.dumps(row), flush=True)

    if args.search and reference is not None:
        torch.set_num_threads(args.gate_threads)
        small = Runner(tokenizer, ids[: args.search_texts], len(labels))
        small_reference = reference[: args.search_texts]
        for keep in ("bf16",):
            started = time.perf_counter()
            criterion = gate_passes
            try:
                plan, trace = search_plan(model, lambda m: small.score(m, no_context), small_reference, criterion,
                                          keep=keep, max_kept=args.search_max_kept)
            except RuntimeError as exc:
                print(f"search ({keep}): {exc}", flush=True)
                continue
            print(f"search ({keep}): {time.perf_counter() - started:.0f} s; kept {len(trace) - 1}: "
                  f"{plan.keep_bf16 or plan.keep_fp32}", flush=True)
            for t in trace:
                print(f"  kept {len(t['kept'])}: max_abs {t['max_abs']:.4f} passed {t['passed']}", flush=True)
            m = apply_plan(copy.deepcopy(model), plan)
            row = {"variant": f"rowwise int8, greedy search, {len(trace) - 1} kept in {keep}"}
            row.update(gate_row(reference, gate.score(m, no_context)))
            torch.set_num_threads(1)
            row.update(speed_row(speed, m, no_context, args.repeats, lin_flops, att_flops))
            row["plan"] = plan.keep_bf16 or plan.keep_fp32
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.onnx_search is not None and reference is not None:
        torch.set_num_threads(args.gate_threads)
        alpha = None if args.onnx_search == "none" else float(args.onnx_search)
        fp32 = onnx_fp32(model, tokenizer, onnx_dir)
        act_max = None if alpha is None else onnx_rowwise.activation_maxima(fp32, feeds())
        started = time.perf_counter()
        kept, trace = onnx_role_search(fp32, onnx_dir, alpha, act_max, lambda m: gate.score(m, no_context), reference)
        print(f"onnx role search (SmoothQuant {alpha}): {time.perf_counter() - started:.0f} s, fp32 roles {kept}",
              flush=True)
        out = onnx_dir / "search-result.onnx"
        onnx_rowwise.rowwise_int8(fp32, out, act_max, alpha, kept)
        m = OrtModel(out)
        row = {"variant": f"onnx rowwise int8 + SmoothQuant a={alpha}, greedy roles, fp32: {', '.join(kept) or 'none'}"}
        row.update(gate_row(reference, gate.score(m, no_context)))
        torch.set_num_threads(1)
        row.update(speed_row(speed, m, no_context, args.repeats, lin_flops, att_flops))
        row["search_trace"] = trace
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
