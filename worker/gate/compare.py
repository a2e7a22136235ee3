"""The gate's one comparison of a candidate's scores against the reference's (`compare`: max and p99
absolute difference, decision flips at every threshold, rank agreement above `RANK_FLOOR`) and the shape
of a budget for it. Pure arithmetic on score rows, so the benchmarks and the int8 tools judge exactly as
the gate does without loading a model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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


THRESHOLD = 0.5
"""Probability at or above which a label counts as set by default."""

THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(1, 10))
"""Decision thresholds checked for flips: 0.1 to 0.9. A deployment's thresholds (and a request's)
are any probability, so the gate holds decisions at every tenth, 0.5 included."""

RANK_FLOOR = 0.05
"""Rank agreement is judged among texts the reference scores at least this on a label. Below it lie
hundreds of benign texts at 0.001-0.01 with gaps of ~1e-4: any reduced precision reshuffles that
near-tie (bf16: Spearman 0.990 over all texts, 0.99995 above the floor), and no moderator reads it."""


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
