"""The measuring harness of `tools.int8_bench`: worker-like padded passes, the gate row against an
unpadded fp32 reference, rank agreement, FLOPs, CPU-time speed and the int8 kernel ceiling."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.gate.compare import compare
from worker.gate.fidelity import REDUCED_BUDGET
from worker.scorer import plan_passes


def load(checkpoint: Path, hf: Path) -> tuple[Any, Any, list[str]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from detoxify import Detoxify  # why: after the env above, which transformers reads at import

    d = Detoxify(checkpoint=str(checkpoint), huggingface_config_path=str(hf))
    return d.model.eval(), d.tokenizer, list(d.class_names)


def ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), as Spearman needs."""
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        r[order[i: j + 1]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 1.0 if np.array_equal(ra, rb) else 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def gate_row(reference: Sequence[Sequence[float]], scores: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The gate's own comparison and budgets (`worker.gate.compare`, `worker.gate.fidelity`), plus two
    diagnostic rank figures: over every text (the issue's first wording, which even bf16 fails on the
    benign near-tie) and on scores rounded to the 2 decimals a dashboard shows."""
    c = compare(reference, scores)
    ref, got = np.asarray(reference, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    return {"max_abs": c.max_abs, "p99_abs": c.p99_abs, "flips_0.5": c.flips / c.texts,
            "flips_worst": c.flip_fraction, "spearman_min_above_0.05": c.min_spearman,
            "spearman_min": min(spearman(ref[:, i], got[:, i]) for i in range(ref.shape[1])),
            "spearman_min_2dp": min(spearman(np.round(ref[:, i], 2), np.round(got[:, i], 2))
                                    for i in range(ref.shape[1])),
            "passed": c.within(REDUCED_BUDGET)}


def gate_passes(reference: Sequence[Sequence[float]], scores: Sequence[Sequence[float]]) -> bool:
    return compare(reference, scores).within(REDUCED_BUDGET)


class Runner:
    """Scores token sequences in worker-like passes with a model and a precision context."""

    def __init__(self, tokenizer: Any, ids: list[list[int]], n_labels: int,
                 max_tokens: int = 1024, max_texts: int = 16) -> None:
        self.tokenizer = tokenizer
        self.ids = ids
        self.n_labels = n_labels
        self.passes = plan_passes([len(s) for s in ids], max_tokens, max_texts)
        self.batches = [tokenizer.pad({"input_ids": [ids[j] for j in group]}, return_tensors="pt")
                        for group in self.passes]

    def padded_tokens(self) -> int:
        return sum(int(b["input_ids"].numel()) for b in self.batches)

    def score(self, model: Any, context: Callable[[], contextlib.AbstractContextManager[Any]]
              ) -> list[list[float]]:
        out: list[list[float] | None] = [None] * len(self.ids)
        with torch.inference_mode(), context():
            for group, batch in zip(self.passes, self.batches, strict=True):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
                probs = torch.sigmoid(logits[:, : self.n_labels].float()).tolist()
                for j, row in zip(group, probs, strict=True):
                    out[j] = row
        return [r for r in out if r is not None]

    def time(self, model: Any, context: Callable[[], contextlib.AbstractContextManager[Any]],
             repeats: int) -> tuple[float, float]:
        """Median (wall, process CPU) seconds of scoring every pass once, after a one-pass warm-up. On
        one thread, CPU seconds are the compute time even when other processes share the core."""
        self.score_subset(model, context, 1)
        walls, cpus = [], []
        for _ in range(repeats):
            started, cpu = time.perf_counter(), time.process_time()
            self.score_subset(model, context, len(self.batches))
            walls.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu)
        return statistics.median(walls), statistics.median(cpus)

    def score_subset(self, model: Any, context: Callable[[], contextlib.AbstractContextManager[Any]],
                     n: int) -> None:
        with torch.inference_mode(), context():
            for batch in self.batches[:n]:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def one_by_one(model: Any, tokenizer: Any, ids: list[list[int]], n_labels: int) -> list[list[float]]:
    out = []
    with torch.inference_mode():
        for seq in ids:
            x = torch.tensor([seq])
            logits = model(input_ids=x, attention_mask=torch.ones_like(x))[0]
            out.append(torch.sigmoid(logits[:, :n_labels]).tolist()[0])
    return out


def flops(model: Any, batches: Sequence[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(FLOPs of every Linear, FLOPs of attention score/context matmuls) for the passes, 2 per MAC."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    h = cfg.hidden_size
    linear_macs_per_token = 0
    counted = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "classifier" not in name and "pooler" not in name:
            counted[name] = module.in_features * module.out_features
    per_token = sum(counted.values())
    if getattr(cfg, "model_type", "") == "albert":
        # One shared layer run num_hidden_layers times; the embedding projection runs once.
        shared = sum(v for k, v in counted.items() if "albert_layer_groups" in k)
        per_token = shared * layers + sum(v for k, v in counted.items() if "albert_layer_groups" not in k)
    linear_macs_per_token = per_token
    lin = att = 0.0
    for b in batches:
        n, length = b["input_ids"].shape
        lin += 2.0 * n * length * linear_macs_per_token
        att += 2.0 * 2 * n * length * length * h * layers
    return lin, att


def kernel_ceiling(m: int = 1024, k: int = 768, n: int = 3072, repeats: int = 10) -> dict[str, float]:
    """Measured ops/s (CPU time, this thread) of one large matmul per dtype: the practical ceiling
    of the kernels the recipes call. 2 ops per multiply-add."""
    torch.manual_seed(0)
    a, w = torch.randn(m, k), torch.randn(n, k)
    ai, wi = a.mul(20).to(torch.int8), w.mul(20).to(torch.int8)
    ab, wb = a.bfloat16(), w.bfloat16()
    calls: dict[str, Callable[[], Any]] = {"fp32": lambda: a @ w.t(), "bf16": lambda: ab @ wb.t(),
                                           "int8 (_int_mm)": lambda: torch._int_mm(ai, wi.t())}
    out = {}
    for name, call in calls.items():
        call()
        cpu = time.process_time()
        for _ in range(repeats):
            call()
        out[name] = 2.0 * m * k * n * repeats / (time.process_time() - cpu) / 1e9
    return out


def speed_row(speed: Runner, model: Any, context: Callable[[], contextlib.AbstractContextManager[Any]],
              repeats: int, lin_flops: float, att_flops: float) -> dict[str, float]:
    wall, cpu = speed.time(model, context, repeats)
    return {"texts_per_s_wall": len(speed.ids) / wall, "texts_per_s_cpu": len(speed.ids) / cpu,
            "linear_gops_cpu": lin_flops / cpu / 1e9, "total_gops_cpu": (lin_flops + att_flops) / cpu / 1e9}


@contextlib.contextmanager
def no_context() -> Iterator[None]:
    yield


def bf16_context() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)
