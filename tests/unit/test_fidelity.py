"""The gate's one comparison (`worker.gate.compare.compare`) and its budgets (`worker.gate.fidelity`): pure
logic on score rows."""

from __future__ import annotations

import pytest

from worker.gate.compare import RANK_FLOOR, compare
from worker.gate.fidelity import FP32_BUDGET, REDUCED_BUDGET


def test_a_flip_at_any_threshold_counts_once_per_text() -> None:
    ref = [[0.1, 0.9], [0.29, 0.51], [0.3, 0.3]]
    got = [[0.6, 0.4], [0.31, 0.51], [0.3, 0.35]]
    c = compare(ref, got)
    assert c.flips == 1  # at 0.5 only the first text
    assert c.worst_flips == 2  # at 0.3 the second text too
    assert c.flip_fraction == pytest.approx(2 / 3)
    assert c.max_abs == pytest.approx(0.5)


def test_p99_ignores_one_outlier_in_a_hundred_and_max_does_not() -> None:
    ref = [[0.5] for _ in range(200)]
    got = [[0.5 + (0.04 if i == 0 else 0.001)] for i in range(200)]
    c = compare(ref, got)
    assert c.p99_abs == pytest.approx(0.001) and c.max_abs == pytest.approx(0.04)


def test_rank_is_judged_only_above_the_floor() -> None:
    """The benign near-tie below RANK_FLOOR may reshuffle; an inversion above it may not."""
    low = [RANK_FLOOR / 10 * (1 + i / 100) for i in range(50)]
    high = [0.1 + 0.8 * i / 50 for i in range(50)]
    ref = [[x] for x in low + high]
    shuffled = [[x] for x in reversed(low)] + [[x] for x in high]
    assert compare(ref, shuffled).min_spearman == pytest.approx(1.0)
    swapped = [[x] for x in low] + [[x] for x in reversed(high)]
    assert compare(ref, swapped).min_spearman == pytest.approx(-1.0)


def test_budgets() -> None:
    """The issue's budgets for reduced precision; fp32 keeps 1e-4."""
    assert (REDUCED_BUDGET.max_abs, REDUCED_BUDGET.p99_abs) == (0.05, 0.01)
    assert (REDUCED_BUDGET.max_flip_fraction, REDUCED_BUDGET.min_spearman) == (0.005, 0.999)
    assert FP32_BUDGET.max_abs == 1e-4
    ref = [[0.25 + i * 1e-5] for i in range(1000)]  # clear of every threshold, even shifted by 0.011
    assert compare(ref, [[x + 0.009] for (x,) in ref]).within(REDUCED_BUDGET)
    assert not compare(ref, [[x + 0.011] for (x,) in ref]).within(REDUCED_BUDGET)
    assert not compare(ref, [[x + 0.001] for (x,) in ref]).within(FP32_BUDGET)


def test_non_finite_scores_fail() -> None:
    ref = [[0.1 * i] for i in range(1, 9)]
    got = [[float("nan")]] + ref[1:]
    assert not compare(ref, got).within(REDUCED_BUDGET)
