"""Summaries of benchmark samples: percentiles, medians with spread, ratios. Pure functions.

Every figure the report prints is the median of repeated measurements with its min-max range, and
every comparison is a ratio of two figures measured in the same run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) with linear interpolation between closest ranks; NaN if empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements and their range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(percentile(finite, 50), min(finite), max(finite), len(finite))

    def ratio(self, other: Spread) -> Spread:
        """self / other: the ratio of medians, with the widest range the two ranges allow."""
        if not other.median or math.isnan(other.median) or not other.low or not other.high:
            return Spread(math.nan, math.nan, math.nan, 0)
        return Spread(self.median / other.median, self.low / other.high, self.high / other.low,
                      min(self.n, other.n))

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n}


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Count, mean and the usual percentiles of a sample (for token lengths)."""
    if not values:
        return {"count": 0}
    out = {"count": float(len(values)), "mean": sum(values) / len(values), "min": float(min(values)),
           "max": float(max(values))}
    for q in (10, 25, 50, 75, 90, 99):
        out[f"p{q}"] = percentile(values, q)
    return out


def cdf_points(values: Sequence[float], points: int = 200) -> list[tuple[float, float]]:
    """(value, fraction <= value) pairs, thinned to about `points`, for plotting a CDF."""
    ordered = sorted(values)
    if not ordered:
        return []
    step = max(1, len(ordered) // points)
    picks = list(range(0, len(ordered), step))
    if picks[-1] != len(ordered) - 1:
        picks.append(len(ordered) - 1)
    return [(ordered[i], (i + 1) / len(ordered)) for i in picks]
