"""The int8 remedies for CPUs without int8 dot products, measured side by side on one checkpoint.

On x86 without VNNI or AMX, ONNX Runtime multiplies uint8 activations by int8 weights with
`vpmaddubsw`, which sums each pair of neighbouring products in saturating int16. The remedies ONNX
Runtime's documentation names, each applied to the export's own int8 recipe (per-row activations,
SmoothQuant, outlier channels kept):

- `onnx-int8-w7`: 7-bit weights (the export's second int8 graph), the same fast kernel;
- U8U8 kernels: ONNX Runtime's `session.x64quantprecision=1` rewrites int8 weights to uint8 for its
  slower U8U8 kernels, but fails to load ALBERT's per-row graph, whose layers share weights (onnxruntime
  1.32: "Attempt to replace the existing tensor"; the tool reports what it says on this checkpoint), so
  the export stores the same weights as uint8 itself (`onnx-int8-u8`): exact, so its error is
  `onnx-int8`'s;
- 7-bit activations: rows quantized to [-63, 63] (GELU rows to 0..127), 8-bit weights.

For each: the gate's row against the torch reference (`worker.gate.fidelity.measure`, the gate corpus),
then texts/s, interleaved over `--repeats` rounds (median, min-max) on THIS CPU. A graph whose products
cannot saturate computes the same on every x86 CPU, so its error here is its error on AVX2; its speed
on AVX2 is not measured here (on a CPU with VNNI every variant runs VNNI kernels, except the U8U8 one).

`--emulate` adds a NUMPY EMULATION of `vpmaddubsw` (not ONNX Runtime): every int8 product's uint8
input, captured on gate texts in worker-sized passes, times its int8 weight, with each pair of
adjacent input channels summed in int16 with saturation, against the exact int32 product. It counts
the saturated pairs and the largest int32 error per graph: it shows the fault and that a remedy avoids
it without an AVX2 machine, not the scores such a machine gives.

    TOXFLEET_CHECKPOINT=models/trained/model.ckpt TOXFLEET_HF_CONFIG=models/trained/hf \\
        python -m tools.int8_avx2 --out /tmp/int8-avx2 --emulate [--texts 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.base import REDUCED, Backend
from worker.backends.loader import load_backend
from worker.backends.onnx import OnnxBackend
from worker.calibration import calibration_texts
from worker.cpus import cpu_model_name, kernel_signature
from worker.gate.cli import format_table
from worker.gate.fidelity import gate_texts, measure, score, speed
from worker.onnx_export import int8_graph as rowwise
from worker.onnx_export.artifacts import (
    DEFAULT_INT8,
    FP32_MODEL,
    INT8_MODEL,
    INT8_U8_MODEL,
    INT8_W7_MODEL,
    export_location,
    verify_export,
)
from worker.onnx_export.build import calibrate_int8, calibration_feeds, ensure_export
from worker.settings import WorkerSettings

U8U8 = {"session.x64quantprecision": "1"}
"""ONNX Runtime's session config entry for its U8U8 kernels on x86 (`kOrtSessionOptionsAvx2PrecisionMode`)."""

INT16_MAX = 32767
INT16_MIN = -32768


def log(step: str) -> None:
    print(f"int8_avx2: {step}", file=sys.stderr, flush=True)


def calibration(directory: Path, tokenizer: Any, settings: WorkerSettings) -> rowwise.Calibration | None:
    """The export recipe's calibration (maxima, and X^T X for GPTQ), as the export computes it."""
    feeds = calibration_feeds(tokenizer, calibration_texts(DEFAULT_INT8.calibration_texts), settings.pass_tokens,
                              settings.pass_texts)
    return calibrate_int8(directory / FP32_MODEL, DEFAULT_INT8, feeds)


def build_variant(directory: Path, path: Path, calibrated: rowwise.Calibration | None, **change: Any) -> Path:
    """The export's int8 recipe with `change` (`smooth_alpha`, `outlier_channels`, `weight_levels`,
    `activation_levels`, `pair_bounded`, `gptq`) applied, written to `path`."""
    recipe = DEFAULT_INT8
    pair_bounded = change.pop("pair_bounded", False)
    gptq = change.pop("gptq", recipe.gptq) and not pair_bounded
    act_max, hessians = calibrated if calibrated is not None else (None, {})
    args: dict[str, Any] = {"alpha": recipe.smooth_alpha, "outliers": recipe.outlier_channels}
    args.update({"alpha": change.pop("smooth_alpha")} if "smooth_alpha" in change else {})
    args.update({"outliers": change.pop("outlier_channels")} if "outlier_channels" in change else {})
    original = rowwise.quantize_columns
    if pair_bounded:
        rowwise.quantize_columns = pair_bounded_columns  # type: ignore[assignment]
    try:
        rowwise.rowwise_int8(directory / FP32_MODEL, path, act_max, args["alpha"], recipe.keep_fp32,
                             recipe.unsigned_gelu, args["outliers"], hessians=hessians if gptq else None, **change)
    finally:
        rowwise.quantize_columns = original  # type: ignore[assignment]
    return path


PAIR_LIMIT = 128
"""255 * 128 = 32,640 <= 32,767: a pair of int8 weights whose magnitudes sum to at most this cannot
saturate `vpmaddubsw` with any uint8 activations."""


def pair_bounded_columns(weight: np.ndarray, levels: int = rowwise.INT8_MAX) -> tuple[np.ndarray, np.ndarray]:
    """EXPERIMENT: int8 per column, scaled so that every pair of adjacent input channels (2j, 2j+1) sums to
    at most `PAIR_LIMIT` in magnitude: nearly 8-bit resolution where large weights are not neighbours.
    Safe only while the kernel pairs channels 2j and 2j+1 (MLAS' AVX2 packing, not a documented contract)."""
    k = weight.shape[0] - weight.shape[0] % 2
    pairs = np.abs(weight[0:k:2]) + np.abs(weight[1:k:2])
    peak = np.maximum(np.abs(weight).max(axis=0) / levels, pairs.max(axis=0) / PAIR_LIMIT)
    scale = np.maximum(peak, 1e-12).astype(np.float32)
    q = np.clip(np.rint(weight / scale[None, :]), -levels, levels).astype(np.int16)
    over = (np.abs(q[0:k:2]) + np.abs(q[1:k:2])) > PAIR_LIMIT  # rounding up may add one
    for half in (0, 1):
        part = q[half:k:2]
        bigger = np.abs(part) >= np.abs(q[1 - half:k:2]) if half == 0 else np.abs(part) > np.abs(q[0:k:2])
        fix = over & bigger
        part[fix] -= np.sign(part[fix])
    return q.astype(np.int8), scale


def u8u8_session(path: Path) -> str:
    """What ONNX Runtime says when asked for its U8U8 kernels on graph `path`: "loads" or its error."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    for key, value in U8U8.items():
        options.add_session_config_entry(key, value)
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # the finding itself: reported, not raised
        return f"fails: {str(exc).splitlines()[0][-160:]}"
    return "loads"


def emulate_saturation(path: Path, feeds: list[dict[str, np.ndarray]], chunk: int = 64) -> dict[str, Any]:
    """NUMPY EMULATION of `vpmaddubsw` on graph `path`'s int8 products (`int8_graph.int8_matmuls`) over
    `feeds`: pairs of adjacent input channels summed in saturating int16, against the exact int32 sums."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    products = [(n.input[0], numpy_helper.to_array(inits[n.input[1]]).astype(np.int32))
                for n in rowwise.int8_matmuls(model.graph)]
    names = sorted({a for a, _ in products})
    for name in names:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    pairs = saturated = outputs = wrong_outputs = 0
    worst = 0
    peak_a = 0
    for feed in feeds:
        captured = dict(zip(names, session.run(names, feed), strict=True))
        for a_name, weight in products:
            # [batch, tokens, channels]; the last layer's products after the first-token cut hold token 0 alone.
            tokens = captured[a_name].shape[1]
            rows_kept = feed["attention_mask"][:, :tokens].reshape(-1) > 0
            a = captured[a_name].reshape(-1, weight.shape[0])[rows_kept].astype(np.int32)
            peak_a = max(peak_a, int(a.max(initial=0)))
            k = weight.shape[0] - weight.shape[0] % 2
            w_even, w_odd = weight[0:k:2], weight[1:k:2]
            for start in range(0, a.shape[0], chunk):
                block = a[start:start + chunk]
                pair = block[:, 0:k:2, None] * w_even[None] + block[:, 1:k:2, None] * w_odd[None]  # [rows, K/2, N]
                clipped = np.clip(pair, INT16_MIN, INT16_MAX)
                pairs += pair.size
                over = pair != clipped
                saturated += int(over.sum())
                error = np.abs((pair - clipped).sum(axis=1))  # exact - emulated, per output element
                outputs += error.size
                wrong_outputs += int((error > 0).sum())
                worst = max(worst, int(error.max(initial=0)))
    return {"matmuls": len(products), "pairs": pairs, "saturated_pairs": saturated,
            "saturated_fraction": saturated / pairs if pairs else 0.0, "outputs": outputs,
            "wrong_outputs": wrong_outputs, "max_int32_error": worst, "max_activation_u8": peak_a,
            "max_weight_abs": max(int(np.abs(w).max()) for _, w in products) if products else 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.int8_avx2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="scratch directory for the built variants")
    parser.add_argument("--texts", type=int, default=1024, help="gate corpus size (default: the gate's 1,024)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (default 5)")
    parser.add_argument("--emulate", action="store_true", help="add the numpy vpmaddubsw emulation")
    parser.add_argument("--tuning", action="store_true",
                        help="add 7-bit-weight variants with other SmoothQuant/outlier settings, and the "
                             "pair-bounded 8-bit experiment")
    parser.add_argument("--emulate-texts", type=int, default=32, help="gate texts the emulation runs on")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    args.out.mkdir(parents=True, exist_ok=True)
    directory = ensure_export(settings)
    manifest = verify_export(directory, export_location(settings)[1])
    fp32 = OnnxBackend(directory, manifest, FP32_MODEL, settings.torch_threads)
    calibrated = calibration(directory, fp32._tokenizer, settings)
    a7 = build_variant(directory, args.out / "int8-a7.onnx", calibrated, activation_levels=rowwise.INT7_MAX)
    variants = {"onnx-int8 (8-bit weights)": directory / INT8_MODEL,
                "onnx-int8-u8 (U8U8 kernels)": directory / INT8_U8_MODEL,
                "onnx-int8-w7 (7-bit weights)": directory / INT8_W7_MODEL,
                "7-bit activations": a7}
    if args.tuning:
        w7 = {"weight_levels": rowwise.INT7_MAX}
        variants.update({
            "8-bit weights rounded to nearest (no GPTQ)": build_variant(directory, args.out / "w8-rtn.onnx",
                                                                        calibrated, gptq=False),
            "7-bit weights rounded to nearest (no GPTQ)": build_variant(directory, args.out / "w7-rtn.onnx",
                                                                        calibrated, gptq=False, **w7),
            "7-bit weights, SmoothQuant a=0.3": build_variant(directory, args.out / "w7-a03.onnx", calibrated,
                                                              smooth_alpha=0.3, **w7),
            "7-bit weights, 64 outlier channels": build_variant(directory, args.out / "w7-k64.onnx", calibrated,
                                                                outlier_channels=64, **w7),
            "pair-bounded 8-bit weights (experiment)": build_variant(directory, args.out / "pairs.onnx", calibrated,
                                                                     pair_bounded=True)})
    texts = gate_texts(args.texts)
    log(f"reference torch on {len(texts)} texts")
    reference = load_backend("torch", settings)
    ref_scores = score(reference, texts, settings)
    labels = list(reference.labels)
    backends: dict[str, Backend] = {"torch": reference, "onnx": fp32}
    rows = []
    for name, path in variants.items():
        log(name)
        backend = OnnxBackend(directory, manifest, path, settings.torch_threads, name=name, precision=REDUCED)
        rows.append(measure(backend, texts, ref_scores, labels, settings))
        backends[name] = backend
    print(format_table(rows))
    rates: dict[str, list[float]] = {name: [] for name in backends}
    for round_ in range(args.repeats):
        log(f"timing round {round_ + 1}/{args.repeats}")
        for name, timed in backends.items():
            rates[name].append(speed(timed, texts, settings))
    base = statistics.median(rates["torch"])
    print(f"\ntexts/s on {cpu_model_name()} [{kernel_signature()}], {settings.torch_threads} thread(s), "
          f"{args.repeats} interleaved rounds (median, min-max, x torch):")
    for name, values in rates.items():
        print(f"  {name}: {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}), "
              f"{statistics.median(values) / base:.2f}x")
    session_option = u8u8_session(directory / INT8_MODEL)
    print(f"\nonnx-int8's graph with session.x64quantprecision=1: {session_option}")
    result: dict[str, Any] = {"cpu": cpu_model_name(), "kernel_signature": kernel_signature(),
                              "rows": [asdict(r) for r in rows], "texts_per_s": rates,
                              "x64quantprecision_on_onnx_int8": session_option}
    if args.emulate:
        feeds = calibration_feeds(fp32._tokenizer, texts[: args.emulate_texts], settings.pass_tokens,
                                  settings.pass_texts)
        result["emulation"] = {}
        print("\nNUMPY EMULATION of vpmaddubsw (int16 pair saturation), not ONNX Runtime:")
        emulated = {"onnx-int8": directory / INT8_MODEL, "onnx-int8-w7": directory / INT8_W7_MODEL,
                    "7-bit activations": a7}  # the U8U8 graph has no u8 x s8 product to emulate
        if args.tuning:
            emulated["pair-bounded 8-bit weights (experiment)"] = args.out / "pairs.onnx"
        for name, path in emulated.items():
            log(f"emulating {name}")
            stats = emulate_saturation(path, feeds)
            result["emulation"][name] = stats
            print(f"  {name}: {stats['saturated_pairs']} of {stats['pairs']} pairs saturate "
                  f"({stats['saturated_fraction']:.2e}); {stats['wrong_outputs']} of {stats['outputs']} int32 "
                  f"outputs wrong, by up to {stats['max_int32_error']}; max u8 activation "
                  f"{stats['max_activation_u8']}, max |weight| {stats['max_weight_abs']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
