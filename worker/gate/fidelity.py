"""The fidelity gate's measurements: every backend against the torch fp32 reference, on a fixed corpus.

For each backend it scores the same texts the way a worker does (tokenized by the backend itself,
sorted, cut into padded passes by `worker.scorer` with the configured budgets, so most texts sit next
to a longer one and carry padding) and compares, against the reference's scores of the same texts
(`compare`, the one comparison the gate and the benchmarks use):

- the largest and the 99th-percentile absolute difference of any probability (`max_abs`, `p99_abs`);
- the fraction of texts whose decision at 0.5, or at any of `THRESHOLDS`, differs in any label
  (`flip_fraction`: the worst threshold's);
- per label, the Spearman rank correlation over the texts the reference scores >= `RANK_FLOOR` on that
  label (`min_spearman`: the worst label's).

Budgets (`FP32_BUDGET`, `REDUCED_BUDGET`; docs/backends.md gives the reasoning and measured figures):
a backend that misses its budget cannot be `auto`'s choice. The reference itself is checked too:
padded passes against one text per pass (no padding at all) on the first texts. The command that
runs it is `python -m worker.gate` (`worker.gate.cli`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.backends import registry
from worker.backends.base import FP32, Backend
from worker.backends.loader import load_backend, unavailable
from worker.gate.probes import probe_texts
from worker.scorer import Scorer, planned
from worker.settings import WorkerSettings


@dataclass(frozen=True)
class Budget:
    max_abs: float
    """Largest allowed absolute probability difference."""
    p99_abs: float
    """Largest allowed 99th percentile of the absolute differences (over every text and label)."""
    max_flip_fraction: float
    """Largest allowed fraction of texts with any label decided differently, at any of `THRESHOLDS`."""
    min_spearman: float
    """Lowest allowed per-label rank correlation over the texts the reference scores >= `RANK_FLOOR`."""


FP32_BUDGET = Budget(max_abs=1e-4, p99_abs=1e-4, max_flip_fraction=0.005, min_spearman=0.999)
"""For backends that compute in fp32: only summation order may differ."""

REDUCED_BUDGET = Budget(max_abs=0.05, p99_abs=0.01, max_flip_fraction=0.005, min_spearman=0.999)
"""For int8 and bf16 backends: what a moderation user would notice. A decision (at 0.5 or at any
threshold) changes on at most 0.5 % of texts, 99 % of probabilities move by at most 0.01 and none by
more than 0.05, and the review order among texts that score at all (>= `RANK_FLOOR`) is kept."""

THRESHOLD = 0.5
"""Probability at or above which a label counts as set by default."""

THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(1, 10))
"""Decision thresholds checked for flips: 0.1 to 0.9. A deployment's thresholds (and a request's)
are any probability, so the gate holds decisions at every tenth, 0.5 included."""

RANK_FLOOR = 0.05
"""Rank agreement is judged among texts the reference scores at least this on a label. Below it lie
hundreds of benign texts at 0.001-0.01 with gaps of ~1e-4: any reduced precision reshuffles that
near-tie (bf16: Spearman 0.990 over all texts, 0.99995 above the floor), and no moderator reads it."""

GATE_SEED = 4242
"""Seed of the gate corpus: fixed, and different from the benchmark corpus."""

DEFAULT_TEXTS = 1024
"""Texts in the gate corpus; at this size one flip is 0.1 %, so the 0.5 % budget allows five."""

REFERENCE_CHECK_TEXTS = 24
"""Texts the reference also scores one per pass, to prove its padded passes match unpadded ones."""

CANDIDATES = registry.candidates()
"""Backends gated by default, besides the reference."""

SPEED_TEXTS = 256
"""Texts of the corpus each backend is timed on, after it scored them all for fidelity."""

SPEED_BATCH = 8
"""Texts per timed batch: about what a worker process takes at once under load (9 at 32 clients on the
trained checkpoint, one at one client). Timed on the whole corpus at once instead, whose 1,024 texts sort
into full passes of near-equal lengths (a shape the fleet rarely has), the gate ranked backends in the
opposite order from the full stack (docs/history.md)."""

EDGE_TEXTS = ["", "ok", "You are an idiot!!!", "Ünïcödé ✓ 😀 — ﬁ", "word " * 800]
"""Texts a tokenizer or truncation mistake shows on: empty, tiny, punctuation, non-ASCII, > 512 tokens."""


def gate_texts(n: int = DEFAULT_TEXTS) -> list[str]:
    """The fixed gate corpus: the edge texts, then comment-like texts of mixed lengths, 70 % of them
    carrying a phrase of `worker.gate.probes` (many ambiguous, so near a threshold on a model trained
    on them, such as `tools.trained`'s)."""
    edge = EDGE_TEXTS[: max(0, n)]
    return edge + probe_texts(max(0, n - len(edge)), GATE_SEED)


@dataclass
class GateRow:
    backend: str
    precision: str
    texts: int
    max_abs: float
    p99_abs: float
    mean_abs: float
    flips: int
    flip_fraction: float
    min_spearman: float
    budget_max_abs: float
    budget_p99_abs: float
    budget_flip_fraction: float
    budget_min_spearman: float
    passed: bool
    texts_per_s: float
    load_seconds: float
    error: str | None = None


@dataclass(frozen=True)
class Comparison:
    """A candidate's scores against the reference's (`compare`)."""

    max_abs: float
    p99_abs: float
    mean_abs: float
    flips: int
    """Texts with any label decided differently at `THRESHOLD` (0.5)."""
    worst_flips: int
    """The same at the worst of `THRESHOLD` and `THRESHOLDS`."""
    min_spearman: float
    texts: int

    @property
    def flip_fraction(self) -> float:
        return self.worst_flips / self.texts if self.texts else 0.0

    def within(self, budget: Budget) -> bool:
        return (self.max_abs <= budget.max_abs and self.p99_abs <= budget.p99_abs
                and self.flip_fraction <= budget.max_flip_fraction and self.min_spearman >= budget.min_spearman)


def compare(reference: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]],
            thresholds: Sequence[float] = THRESHOLDS) -> Comparison:
    """The gate's one comparison of a candidate's scores against the reference's (rows of labels)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} rows against {len(reference)} reference rows")
    cuts = sorted({THRESHOLD, *thresholds})
    flips = dict.fromkeys(cuts, 0)
    diffs: list[float] = []
    for ref_row, row in zip(reference, candidate, strict=True):
        if len(ref_row) != len(row):
            raise ValueError(f"{len(row)} labels against {len(ref_row)} in the reference")
        diffs.extend(abs(r - c) if math.isfinite(c) else math.inf for r, c in zip(ref_row, row, strict=True))
        for cut in cuts:
            flips[cut] += any((r >= cut) != (c >= cut) for r, c in zip(ref_row, row, strict=True))
    labels = len(reference[0]) if reference else 0
    rank = min((_spearman([r[i] for r in reference if r[i] >= RANK_FLOOR],
                          [c[i] for r, c in zip(reference, candidate, strict=True) if r[i] >= RANK_FLOOR])
                for i in range(labels)), default=1.0)
    ordered = sorted(diffs)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0
    return Comparison(ordered[-1] if ordered else 0.0, p99, sum(diffs) / len(diffs) if diffs else 0.0,
                      flips[THRESHOLD], max(flips.values()), rank, len(reference))


def _ranks(values: Sequence[float]) -> list[float]:
    """Average ranks (ties share their mean rank), as Spearman needs."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation; 1.0 for fewer than 3 values (nothing to order), NaN-safe (a
    non-finite candidate score ranks nowhere: -1.0)."""
    if len(a) < 3:
        return 1.0
    if not all(math.isfinite(x) for x in b):
        return -1.0
    ra, rb = _ranks(a), _ranks(b)
    mean = (len(a) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - mean) ** 2 for x in ra)
    var_b = sum((y - mean) ** 2 for y in rb)
    if var_a == 0 or var_b == 0:
        return 1.0 if ra == rb else 0.0
    return cov / math.sqrt(var_a * var_b)


def budget_for(precision: str) -> Budget:
    return FP32_BUDGET if precision == FP32 else REDUCED_BUDGET


def precision_of(name: str) -> str:
    """A backend's precision class from its name, for rows of backends that could not load."""
    return registry.precision(name)


def score(backend: Backend, texts: Sequence[str], settings: WorkerSettings) -> list[list[float]]:
    """Scores as lists in label order, the whole corpus sorted into the configured passes at once: the
    fullest passes a worker makes, where a scale shared by the texts of a pass (int8) errs most."""
    results, _ = Scorer(backend, settings.pass_tokens, settings.pass_texts).score(texts)
    return [[r[label] for label in backend.labels] for r in results]


def speed(backend: Backend, texts: Sequence[str], settings: WorkerSettings) -> float:
    """Texts/s scoring the first `SPEED_TEXTS` texts as a worker under load does: `SPEED_BATCH` at a time,
    in corpus order (mixed lengths), planned with the backend's own cost of a pass (after a warm-up)."""
    scorer = planned(backend, settings.pass_tokens, settings.pass_texts, settings.pass_overhead_tokens)
    sample = texts[:SPEED_TEXTS]
    batches = [sample[i:i + SPEED_BATCH] for i in range(0, len(sample), SPEED_BATCH)]
    scorer.score(batches[0])  # warm-up
    started = time.perf_counter()
    for batch in batches:
        scorer.score(batch)
    return len(sample) / (time.perf_counter() - started)


def measure(backend: Backend, texts: Sequence[str], reference: Sequence[Sequence[float]],
            reference_labels: Sequence[str], settings: WorkerSettings) -> GateRow:
    """One backend's gate row against reference scores of the same texts."""
    budget = budget_for(backend.precision)
    if list(backend.labels) != list(reference_labels):
        return _failed(backend.name, backend.precision, len(texts), budget,
                       f"labels {backend.labels} differ from the reference's {list(reference_labels)}")
    scores = score(backend, texts, settings)
    return _row(backend.name, backend.precision, compare(reference, scores), budget, speed(backend, texts, settings),
                backend.load_seconds)


def _row(name: str, precision: str, c: Comparison, budget: Budget, rate: float, load_seconds: float) -> GateRow:
    return GateRow(name, precision, c.texts, c.max_abs, c.p99_abs, c.mean_abs, c.worst_flips, c.flip_fraction,
                   c.min_spearman, budget.max_abs, budget.p99_abs, budget.max_flip_fraction, budget.min_spearman,
                   c.within(budget), rate, load_seconds)


def _failed(name: str, precision: str, texts: int, budget: Budget, error: str) -> GateRow:
    return GateRow(name, precision, texts, math.inf, math.inf, math.inf, texts, 1.0, -1.0, budget.max_abs,
                   budget.p99_abs, budget.max_flip_fraction, budget.min_spearman, False, 0.0, 0.0, error)


def reference_row(reference: Backend, texts: Sequence[str], scores: Sequence[Sequence[float]],
                  rate: float) -> GateRow:
    """The reference's own row: its padded passes against one text per pass (no padding)."""
    n = min(REFERENCE_CHECK_TEXTS, len(texts))
    ids = reference.tokenize(texts[:n])
    alone = [reference.predict([seq])[0] for seq in ids]
    return _row(reference.name, reference.precision, compare(alone, scores[:n]), FP32_BUDGET, rate,
                reference.load_seconds)


def _quiet(_: str) -> None:
    pass


def run_gate(settings: WorkerSettings, backends: Sequence[str] = CANDIDATES,
             texts: Sequence[str] | None = None, progress: Callable[[str], None] = _quiet) -> list[GateRow]:
    """The gate table: the reference's row first, then one row per backend (a backend that cannot load
    on this machine gets a failed row saying why); `progress` hears each step."""
    texts = list(gate_texts() if texts is None else texts)
    progress(f"reference torch on {len(texts)} texts")
    reference = load_backend("torch", settings)
    ref_scores = score(reference, texts, settings)
    rows = [reference_row(reference, texts, ref_scores, speed(reference, texts, settings))]
    labels = list(reference.labels)
    del reference
    gc.collect()
    for name in backends:
        precision = precision_of(name)
        reason = unavailable(name)
        if reason is not None:
            rows.append(_failed(name, precision, len(texts), budget_for(precision), f"cannot run here: {reason}"))
            continue
        try:
            backend = load_backend(name, settings)
        except Exception as exc:
            rows.append(_failed(name, precision, len(texts), budget_for(precision), f"cannot load: {exc}"))
            continue
        progress(f"{name} on {len(texts)} texts")
        rows.append(measure(backend, texts, ref_scores, labels, settings))
        progress(f"{name}: {'pass' if rows[-1].passed else 'FAIL'} (max abs {rows[-1].max_abs:.2e})")
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
    lines = ["| backend | precision | texts | max abs | p99 abs | flips (worst threshold) | min Spearman "
             f"(ref >= {RANK_FLOOR:g}) | budget (max / p99 / flips / rank) | gate | texts/s | x torch | load s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.texts_per_s / reference_rate:.2f}" if reference_rate and row.texts_per_s else "-"
        gate = "pass" if row.passed else ("FAIL" if row.error is None else f"FAIL: {row.error}")
        lines.append(f"| {row.backend} | {row.precision} | {row.texts} | {row.max_abs:.2e} | {row.p99_abs:.2e} | "
                     f"{row.flips} ({row.flip_fraction:.2%}) | {row.min_spearman:.5f} | {row.budget_max_abs:g} / "
                     f"{row.budget_p99_abs:g} / {row.budget_flip_fraction:.1%} / {row.budget_min_spearman:g} "
                     f"| {gate} | {row.texts_per_s:.1f} | {ratio} | {row.load_seconds:.2f} |")
    return "\n".join(lines)
