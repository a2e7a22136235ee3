"""Raw backend benchmark (no server, no queue): texts/s, load time, memory and fidelity per backend.

Every backend, and a few ONNX Runtime int8 and bf16 variants worth comparing, scores the same
realistic corpus the way a worker does (`worker.scorer`: tokenize, sort by length, padded passes of
TOXFLEET_PASS_TOKENS / TOXFLEET_PASS_TEXTS), in fresh processes, in two layouts on N cores:

- `1xN`: one process with N intra-op threads;
- `Nx1`: N processes with one thread each, released together by a barrier, each scoring its share.

Reported per variant and layout: median texts/s over repeats with min-max, texts/s per core, the ratio
to torch fp32 in the same run, seconds to load (imports + weights + session), resident memory per
process after loading and at peak, useful operations per second (real tokens only) against this
CPU's peak, and the fidelity against torch fp32 on the same texts (max abs probability difference,
texts with a flipped label). Timings on a shared machine are indicative only.

    .venv/bin/python -m bench.backends                         # models/unbiased-small, defaults
    .venv/bin/python -m bench.backends --quick                 # fewer texts and repeats
    TOXFLEET_CHECKPOINT=... TOXFLEET_HF_CONFIG=... .venv/bin/python -m bench.backends --variants torch,onnx-int8
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleet.corpus import DEFAULT_SEED, CommentCorpus
from worker.backends.base import REDUCED, Backend
from worker.backends.loader import load_backend
from worker.backends.onnx import OnnxBackend
from worker.backends.torch import TorchBackend
from worker.cpus import cpu_model_name, kernel_signature
from worker.gate.compare import compare
from worker.onnx_export import artifacts, build
from worker.scorer import Scorer
from worker.settings import WorkerSettings
from worker.weights import load_detoxify

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_TEXTS = 96
DEFAULT_REPEATS = 3

CLOCK_GHZ = 2.6
"""Clock assumed for peak figures (this machine's /proc/cpuinfo 'cpu MHz'); turbo is not counted."""

PEAK_OPS_PER_CYCLE = {
    "fp32 AVX-512 (2 FMA)": 64,
    "int8 AVX-512 VNNI (2 ports)": 256,
    "bf16 AMX": 1024,
    "int8 AMX": 2048,
}
"""Per-core operations per cycle (a multiply-add counts 2) for the units this CPU has."""

VARIANTS: dict[str, dict[str, Any]] = {
    "torch": {"kind": "backend", "precision": "fp32", "note": "Detoxify's model, the reference"},
    "torch-compiled": {"kind": "backend", "precision": "fp32",
                       "note": "torch through torch.compile (TorchInductor, frozen fp32 weights)"},
    "torch-int8": {"kind": "backend", "precision": "reduced", "note": "torch.ao dynamic int8, Linear layers"},
    "torch-bf16": {"kind": "backend", "precision": "reduced", "note": "torch.autocast bf16 (AMX)"},
    "torch-bf16-compiled": {"kind": "backend", "precision": "reduced",
                            "note": "torch-bf16 through torch.compile (TorchInductor, frozen bf16 weights)"},
    "torch-bf16-weights": {"kind": "bf16-weights", "precision": "reduced", "note": "model.to(bfloat16), bench only"},
    "onnx": {"kind": "backend", "precision": "fp32", "note": "ORT fp32, folded + fused (export default)"},
    "onnx-unfused": {"kind": "file", "file": "folded.onnx", "precision": "fp32",
                     "note": "ORT fp32, folded, no transformer fusion"},
    "onnx-int8": {"kind": "backend", "precision": "reduced",
                  "note": "the export's int8 graph (artifacts.DEFAULT_INT8: per-row MatMulInteger + SmoothQuant)"},
    "onnx-int8-tensor": {"kind": "file", "file": "int8-tensor.onnx", "precision": "reduced",
                         "note": "ORT dynamic int8 (per-tensor activations), one weight scale per matrix"},
    "onnx-int8-gather": {"kind": "file", "file": "int8-gather.onnx", "precision": "reduced",
                         "note": "ORT dynamic int8 (per-tensor activations), per-channel, plus the embedding Gather"},
    "onnx-int8-unfused": {"kind": "file", "file": "int8-unfused.onnx", "precision": "reduced",
                          "note": "ORT dynamic int8 (per-tensor activations), per-channel, on the unfused graph"},
    "onnx-int8-qdq": {"kind": "file", "file": "int8-qdq.onnx", "precision": "reduced",
                      "note": "static QDQ, activations calibrated on 32 corpus texts"},
    "onnx-nbits8": {"kind": "file", "file": "nbits8.onnx", "precision": "reduced",
                    "note": "MatMulNBits 8-bit weights, block 128, int8 compute (accuracy_level 4)"},
}


# --- measurement, in child processes -----------------------------------------------------------------


def _rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return math.nan


def _build(name: str, spec: dict[str, Any], threads: int, work: str) -> Backend:
    settings = WorkerSettings(torch_threads=threads, backend="torch")
    if spec["kind"] == "backend":
        return load_backend(name, settings)
    if spec["kind"] == "bf16-weights":
        import torch  # heavy optional dependency, imported in the child after OMP_NUM_THREADS is set

        torch.set_num_threads(threads)
        detoxify = load_detoxify(settings)
        detoxify.model = detoxify.model.to(torch.bfloat16)

        class Bf16Weights(TorchBackend):
            def predict(self, batch: Any) -> list[list[float]]:
                with torch.inference_mode():
                    logits = self._model(**self.padded(batch))[0]
                out: list[list[float]] = torch.sigmoid(logits[:, : len(self.labels)].float()).tolist()
                return out

        backend = Bf16Weights(detoxify, settings.model_identity)
        backend.name, backend.precision = name, REDUCED
        return backend
    directory, sha = artifacts.export_location(settings)
    manifest = artifacts.verify_export(directory, sha, files=[])
    return OnnxBackend(directory, manifest, Path(work) / spec["file"], threads, name=name,
                       precision=spec["precision"])


def _child(index: int, name: str, spec: dict[str, Any], threads: int, texts: list[str], repeats: int, work: str,
           barrier: Any, queue: Any, started: float) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        settings = WorkerSettings()
        t0 = time.perf_counter()
        backend = _build(name, spec, threads, work)
        load = time.perf_counter() - t0
        ready = time.time() - started
        rss_loaded = _rss_mb()
        scorer = Scorer(backend, settings.pass_tokens, settings.pass_texts)
        scorer.score(texts[:4])
        times: list[float] = []
        scores: list[list[float]] = []
        stats: Any = None
        for _ in range(repeats):
            barrier.wait(timeout=600)
            t = time.perf_counter()
            rows, stats = scorer.score(texts)
            times.append(time.perf_counter() - t)
            scores = [[r[label] for label in backend.labels] for r in rows]
        queue.put({"ok": True, "index": index, "times": times, "load_s": load, "ready_s": ready,
                   "rss_loaded_mb": rss_loaded, "rss_peak_mb": _rss_mb("VmHWM"), "scores": scores,
                   "tokens": stats.tokens, "padded_tokens": stats.padded_tokens, "passes": stats.passes})
    except Exception as exc:
        barrier.abort()
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})


def measure(name: str, spec: dict[str, Any], processes: int, threads: int, texts: list[str], repeats: int,
            work: str) -> dict[str, Any]:
    """One variant in one layout: per-repeat aggregate texts/s and per-process load and memory."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    queue = ctx.Queue()
    shares = [texts[i::processes] for i in range(processes)]
    started = time.time()
    procs = [ctx.Process(target=_child, args=(i, name, spec, threads, share, repeats, work, barrier, queue, started))
             for i, share in enumerate(shares)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        return {"error": failed[0]}
    results.sort(key=lambda r: int(r["index"]))
    # Repeats are barrier-aligned: a repeat lasts as long as its slowest process.
    walls = [max(r["times"][k] for r in results) for k in range(repeats)]
    rates = [len(texts) / w for w in walls]
    scores = [row for r in results for row in r["scores"]]
    order = [i for share_idx in range(processes) for i in range(len(texts))[share_idx::processes]]
    in_order: list[list[float]] = [[] for _ in texts]
    for i, row in zip(order, scores, strict=True):
        in_order[i] = row
    return {
        "rates": rates, "median": statistics.median(rates), "min": min(rates), "max": max(rates),
        "load_s": statistics.median(r["load_s"] for r in results),
        "ready_s": max(r["ready_s"] for r in results),
        "rss_loaded_mb": statistics.median(r["rss_loaded_mb"] for r in results),
        "rss_peak_mb": max(r["rss_peak_mb"] for r in results),
        "tokens": sum(r["tokens"] for r in results), "padded_tokens": sum(r["padded_tokens"] for r in results),
        "scores": in_order,
    }


# --- preparation, in the main process ----------------------------------------------------------------


def prepare(work: Path, wanted: list[str]) -> dict[str, str]:
    """Make sure the export exists and build the variant graphs the run needs; returns skip reasons."""
    settings = WorkerSettings()
    directory = build.ensure_export(settings)
    work.mkdir(parents=True, exist_ok=True)
    files = {spec["file"] for name, spec in VARIANTS.items() if name in wanted and spec["kind"] == "file"}
    skipped: dict[str, str] = {}
    if not files:
        return skipped
    fused = directory / artifacts.FP32_MODEL
    folded = work / "folded.onnx"
    if not folded.exists() and files & {"folded.onnx", "int8-unfused.onnx"}:
        detoxify = load_detoxify(settings)
        model = detoxify.model.eval()
        model.set_attn_implementation("eager")
        build.export_onnx(model, work / "raw.onnx", model.config.vocab_size, detoxify.tokenizer.pad_token_id)
        build.fold(work / "raw.onnx", folded)
        (work / "raw.onnx").unlink()
    # The per-tensor dynamic recipe's variants (the export's own int8 graph is per-row, `onnx-int8`).
    dynamic = artifacts.PER_TENSOR_INT8
    builders: dict[str, Callable[[Path], object]] = {
        "int8-tensor.onnx": lambda out: build.quantize_int8(fused, out, replace(dynamic, per_channel=False)),
        "int8-gather.onnx": lambda out: build.quantize_int8(
            fused, out, replace(dynamic, op_types=("MatMul", "Gather"))),
        "int8-unfused.onnx": lambda out: build.quantize_int8(folded, out, dynamic),
        "int8-qdq.onnx": lambda out: _quantize_qdq(fused, out, directory),
        "nbits8.onnx": lambda out: _quantize_nbits8(fused, out),
    }
    for file in sorted(files - {"folded.onnx"}):
        out = work / file
        if out.exists():
            continue
        try:
            builders[file](out)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:200]
            skipped.update({n: reason for n, s in VARIANTS.items() if s.get("file") == file})
    return skipped


def _quantize_nbits8(src: Path, dst: Path) -> None:
    # Heavy optional dependencies (the `onnx` extra), only for this variant.
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=8, block_size=128, is_symmetric=True,
                                     accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst))


def _quantize_qdq(src: Path, dst: Path, directory: Path) -> None:
    # Heavy optional dependencies (the `onnx` extra), only for this variant.
    import numpy as np
    import transformers
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    manifest = artifacts.read_manifest(directory)
    tokenizer = getattr(transformers, manifest.tokenizer_class).from_pretrained(
        str(directory / artifacts.TOKENIZER_DIR))
    texts = CommentCorpus(DEFAULT_SEED + 1).texts(32)

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._items = iter(tokenizer(texts, truncation=True, max_length=512)["input_ids"])

        def get_next(self) -> dict[str, Any] | None:
            ids = next(self._items, None)
            if ids is None:
                return None
            arr = np.asarray([ids], dtype=np.int64)
            return {"input_ids": arr, "attention_mask": np.ones_like(arr)}

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])


def model_ops_per_text(tokens: int, padded: int, texts: int) -> tuple[float, float]:
    """(useful, computed) operations per text: 2 per multiply-add over the encoder's matrices, on real
    tokens and on padded tokens (the attention term is small at these lengths and left out)."""
    settings = WorkerSettings()
    config = json.loads(((settings.hf_config or Path()) / "config.json").read_text()) if settings.hf_config else {}
    d = config.get("hidden_size", 768)
    f = config.get("intermediate_size", 3072)
    layers = config.get("num_hidden_layers", 12)
    per_token = 2 * layers * (4 * d * d + 2 * d * f)
    return per_token * tokens / texts, per_token * padded / texts


def fidelity(reference: list[list[float]], scores: list[list[float]]) -> tuple[float, float]:
    """(max abs difference, fraction of texts with any label flipped at p >= 0.5), by the gate's
    own comparison."""
    c = compare(reference, scores)
    return c.max_abs, c.flips / len(reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=DEFAULT_TEXTS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layouts", default="1xN,Nx1", help="1xN (one process, N threads), Nx1 (N processes)")
    parser.add_argument("--work", type=Path, default=ROOT / "var" / "bench-backends",
                        help="where variant graphs are built (cached per checkpoint)")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--quick", action="store_true", help="48 texts, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.repeats = 48, 2
    models = ROOT / "models" / "unbiased-small"
    if "TOXFLEET_CHECKPOINT" not in os.environ and (models / "model.ckpt").is_file():
        os.environ["TOXFLEET_CHECKPOINT"] = str(models / "model.ckpt")
        os.environ["TOXFLEET_HF_CONFIG"] = str(models / "hf")
    wanted = [v for v in args.variants.split(",") if v]
    if "torch" not in wanted:
        wanted.insert(0, "torch")  # every ratio and fidelity figure is against it
    unknown = set(wanted) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    _, sha = artifacts.export_location(WorkerSettings())
    work = args.work / sha[:16]
    skipped = prepare(work, wanted)
    texts = CommentCorpus(DEFAULT_SEED).texts(args.texts)  # the benchmark corpus, not the gate's
    settings = WorkerSettings()
    n = args.cores
    layouts = {"1xN": (1, n), "Nx1": (n, 1)}
    print(f"# backends on {cpu_model_name()} [{kernel_signature()}], {n} cores; {settings.model_identity}; "
          f"{len(texts)} texts, passes <= {settings.pass_tokens} padded tokens / {settings.pass_texts} texts; "
          f"median of {args.repeats} (min-max)\n")
    results: dict[str, Any] = {"texts": len(texts), "cores": n, "repeats": args.repeats, "cpu": cpu_model_name(),
                               "signature": kernel_signature(), "model": settings.model_identity, "layouts": {}}
    for layout in [x for x in args.layouts.split(",") if x]:
        processes, threads = layouts[layout]
        rows: dict[str, dict[str, Any]] = {}
        for name in wanted:
            if name in skipped:
                rows[name] = {"error": f"not built: {skipped[name]}"}
            else:
                rows[name] = measure(name, VARIANTS[name], processes, threads, texts, args.repeats, str(work))
            print(f"  {layout} {name}: " + (rows[name].get("error") or f"{rows[name]['median']:.2f} texts/s"),
                  file=sys.stderr, flush=True)
        results["layouts"][layout] = _table(layout, processes, threads, rows, len(texts))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


def _table(layout: str, processes: int, threads: int, rows: dict[str, dict[str, Any]], n_texts: int) -> dict[str, Any]:
    reference = rows["torch"]
    ref_rate = reference.get("median", math.nan)
    cores = processes * threads
    print(f"## {layout}: {processes} process(es) x {threads} thread(s)\n")
    print("| variant | texts/s median (min-max) | per core | x torch | max abs diff | label flips | load s "
          "| RSS MB loaded / peak | useful GOP/s | % fp32 peak | % int8 VNNI peak | % int8 AMX peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    table: dict[str, Any] = {}
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | {row['error']} |" + " |" * 10)
            table[name] = row
            continue
        worst, flips = fidelity(reference["scores"], row["scores"]) if "scores" in reference else (math.nan, math.nan)
        useful, _ = model_ops_per_text(row["tokens"], row["padded_tokens"], n_texts)
        gops = useful * row["median"] / 1e9
        peak = {k: v * CLOCK_GHZ * cores for k, v in PEAK_OPS_PER_CYCLE.items()}  # GOP/s
        print(f"| {name} | {row['median']:.2f} ({row['min']:.2f}-{row['max']:.2f}) | {row['median'] / cores:.2f} "
              f"| {row['median'] / ref_rate:.2f} | {worst:.2e} | {flips:.1%} | {row['load_s']:.2f} "
              f"| {row['rss_loaded_mb']:.0f} / {row['rss_peak_mb']:.0f} | {gops:.0f} "
              f"| {100 * gops / peak['fp32 AVX-512 (2 FMA)']:.0f} "
              f"| {100 * gops / peak['int8 AVX-512 VNNI (2 ports)']:.0f} "
              f"| {100 * gops / peak['int8 AMX']:.1f} |")
        table[name] = {k: v for k, v in row.items() if k != "scores"} | {
            "ratio": row["median"] / ref_rate, "max_abs": worst, "flip_fraction": flips, "useful_gops": gops,
            "note": VARIANTS[name]["note"]}
    print()
    for name in rows:
        print(f"- `{name}`: {VARIANTS[name]['note']}")
    print(f"\nPadding: {rows['torch'].get('padded_tokens', 0) / max(1, rows['torch'].get('tokens', 1)):.2f} "
          "computed tokens per real token.\n")
    return table


if __name__ == "__main__":
    sys.exit(main())
