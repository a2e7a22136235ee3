"""The fidelity gate's measurements: every backend against the torch fp32 reference, on a fixed corpus.

For each backend it scores the same texts the way a worker does (tokenized by the backend itself,
sorted, cut into padded passes by `worker.scorer` with the configured budgets, so most texts sit next
to a longer one and carry padding) and reports, against the reference's scores of the same texts
(`compare`, the one comparison the gate and the benchmarks use):

- the largest absolute difference of any probability (`max_abs`);
- the fraction of texts whose thresholded labels (p >= 0.5) differ in any label (`flips`).

Budgets: fp32 backends 1e-4; reduced-precision (int8, bf16) backends 0.02 and 1 % of texts. A
backend that misses its budget cannot be `auto`'s choice. The reference itself is checked too:
padded passes against one text per pass (no padding at all) on the first texts. The command that
runs it is `python -m worker.gate` (`worker.gate.cli`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from toxfleet.corpus import CommentCorpus
from worker.backends.base import FP32, REDUCED, Backend
from worker.backends.loader import load_backend
from worker.backends.reduced import BF16_FLAGS
from worker.cpus import cpu_flags
from worker.scorer import Scorer
from worker.settings import WorkerSettings


@dataclass(frozen=True)
class Budget:
    max_abs: float
    """Largest allowed absolute probability difference."""
    max_flip_fraction: float
    """Largest allowed fraction of texts with any thresholded label different."""


FP32_BUDGET = Budget(1e-4, 0.01)
"""For backends that compute in fp32: only summation order may differ."""

REDUCED_BUDGET = Budget(0.02, 0.01)
"""For int8 and bf16 backends."""

THRESHOLD = 0.5
"""Probability at or above which a label counts as set."""

GATE_SEED = 4242
"""Seed of the gate corpus: fixed, and different from the benchmark corpus."""

DEFAULT_TEXTS = 256
"""Texts in the gate corpus; at this size one flip is 0.4 %, so the 1 % budget allows two."""

REFERENCE_CHECK_TEXTS = 24
"""Texts the reference also scores one per pass, to prove its padded passes match unpadded ones."""

CANDIDATES = ("torch-int8", "torch-bf16", "onnx", "onnx-int8")
"""Backends gated by default, besides the reference."""

EDGE_TEXTS = ["", "ok", "You are an idiot!!!", "Ünïcödé ✓ 😀 — ﬁ", "word " * 800]
"""Texts a tokenizer or truncation mistake shows on: empty, tiny, punctuation, non-ASCII, > 512 tokens."""


def gate_texts(n: int = DEFAULT_TEXTS) -> list[str]:
    """The fixed gate corpus: the edge texts, then seeded comment-like texts of mixed lengths."""
    edge = EDGE_TEXTS[: max(0, n)]
    return edge + CommentCorpus(GATE_SEED).texts(max(0, n - len(edge)))


@dataclass
class GateRow:
    backend: str
    precision: str
    texts: int
    max_abs: float
    mean_abs: float
    flips: int
    flip_fraction: float
    budget_max_abs: float
    budget_flip_fraction: float
    passed: bool
    texts_per_s: float
    load_seconds: float
    error: str | None = None


def compare(reference: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]]) -> tuple[float, float, int]:
    """(max abs difference, mean abs difference, texts with any thresholded label different)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} rows against {len(reference)} reference rows")
    worst, total, count, flips = 0.0, 0.0, 0, 0
    for ref_row, row in zip(reference, candidate, strict=True):
        if len(ref_row) != len(row):
            raise ValueError(f"{len(row)} labels against {len(ref_row)} in the reference")
        flipped = False
        for r, c in zip(ref_row, row, strict=True):
            diff = abs(r - c) if math.isfinite(c) else math.inf
            worst = max(worst, diff)
            total += diff
            count += 1
            flipped |= (r >= THRESHOLD) != (c >= THRESHOLD)
        flips += flipped
    return worst, (total / count if count else 0.0), flips


def budget_for(precision: str) -> Budget:
    return FP32_BUDGET if precision == FP32 else REDUCED_BUDGET


def precision_of(name: str) -> str:
    """A backend's precision class from its name, for rows of backends that could not load."""
    return FP32 if name in ("torch", "onnx") else REDUCED


def score(backend: Backend, texts: Sequence[str], settings: WorkerSettings) -> tuple[list[list[float]], float]:
    """Scores as lists in label order, and texts/s, scoring like a worker (after a short warm-up)."""
    scorer = Scorer(backend, settings.pass_tokens, settings.pass_texts)
    scorer.score(texts[:8])
    started = time.perf_counter()
    results, _ = scorer.score(texts)
    elapsed = time.perf_counter() - started
    return [[r[label] for label in backend.labels] for r in results], len(texts) / elapsed


def measure(backend: Backend, texts: Sequence[str], reference: Sequence[Sequence[float]],
            reference_labels: Sequence[str], settings: WorkerSettings) -> GateRow:
    """One backend's gate row against reference scores of the same texts."""
    budget = budget_for(backend.precision)
    if list(backend.labels) != list(reference_labels):
        return _failed(backend.name, backend.precision, len(texts), budget,
                       f"labels {backend.labels} differ from the reference's {list(reference_labels)}")
    scores, rate = score(backend, texts, settings)
    worst, mean, flips = compare(reference, scores)
    fraction = flips / len(texts) if texts else 0.0
    passed = worst <= budget.max_abs and fraction <= budget.max_flip_fraction
    return GateRow(backend.name, backend.precision, len(texts), worst, mean, flips, fraction, budget.max_abs,
                   budget.max_flip_fraction, passed, rate, backend.load_seconds)


def _failed(name: str, precision: str, texts: int, budget: Budget, error: str) -> GateRow:
    return GateRow(name, precision, texts, math.inf, math.inf, texts, 1.0, budget.max_abs, budget.max_flip_fraction,
                   False, 0.0, 0.0, error)


def reference_row(reference: Backend, texts: Sequence[str], scores: Sequence[Sequence[float]],
                  rate: float) -> GateRow:
    """The reference's own row: its padded passes against one text per pass (no padding)."""
    n = min(REFERENCE_CHECK_TEXTS, len(texts))
    ids = reference.tokenize(texts[:n])
    alone = [reference.predict([seq])[0] for seq in ids]
    worst, mean, flips = compare(alone, scores[:n])
    budget = FP32_BUDGET
    fraction = flips / n if n else 0.0
    return GateRow(reference.name, reference.precision, n, worst, mean, flips, fraction, budget.max_abs,
                   budget.max_flip_fraction, worst <= budget.max_abs and fraction <= budget.max_flip_fraction,
                   rate, reference.load_seconds)


def run_gate(settings: WorkerSettings, backends: Sequence[str] = CANDIDATES,
             texts: Sequence[str] | None = None) -> list[GateRow]:
    """The gate table: the reference's row first, then one row per backend (a backend that cannot load
    on this machine gets a failed row saying why)."""
    texts = list(gate_texts() if texts is None else texts)
    reference = load_backend("torch", settings)
    ref_scores, ref_rate = score(reference, texts, settings)
    rows = [reference_row(reference, texts, ref_scores, ref_rate)]
    labels = list(reference.labels)
    del reference
    gc.collect()
    for name in backends:
        precision = precision_of(name)
        if name == "torch-bf16" and not any(flag in cpu_flags() for flag in BF16_FLAGS):
            rows.append(_failed(name, precision, len(texts), budget_for(precision), "this CPU has no bf16 units"))
            continue
        try:
            backend = load_backend(name, settings)
        except Exception as exc:
            rows.append(_failed(name, precision, len(texts), budget_for(precision), f"cannot load: {exc}"))
            continue
        rows.append(measure(backend, texts, ref_scores, labels, settings))
        del backend
        gc.collect()
    return rows


def choose(rows: Sequence[GateRow]) -> str:
    """The fastest backend that passed (the reference always may be chosen if it passed its check)."""
    passed = [row for row in rows if row.passed and row.error is None]
    if not passed:
        raise RuntimeError("no backend passed the fidelity gate, not even the reference")
    return max(passed, key=lambda row: row.texts_per_s).backend


def format_table(rows: Sequence[GateRow]) -> str:
    reference_rate = rows[0].texts_per_s if rows else 0.0
    lines = ["| backend | precision | texts | max abs diff | label flips | budget (abs / flips) | gate | texts/s "
             "| x torch | load s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.texts_per_s / reference_rate:.2f}" if reference_rate and row.texts_per_s else "-"
        gate = "pass" if row.passed else ("FAIL" if row.error is None else f"FAIL: {row.error}")
        lines.append(f"| {row.backend} | {row.precision} | {row.texts} | {row.max_abs:.2e} | "
                     f"{row.flips} ({row.flip_fraction:.1%}) | {row.budget_max_abs:g} / {row.budget_flip_fraction:.0%} "
                     f"| {gate} | {row.texts_per_s:.1f} | {ratio} | {row.load_seconds:.2f} |")
    return "\n".join(lines)
