"""What the benchmark report is built from: the series and the issue's targets, the points of a results
file selected and summarised as spreads, number formatting, and the markdown table.

`bench.sections` and `bench.plots` build on it; `bench.report` puts them together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from bench.stats import Spread

Point = dict[str, Any]

SERIES = (("baseline", "baseline"), ("toxfleet", "compat"), ("toxfleet", "jobs"))
"""(system, mode) pairs, in the order tables and plots show them."""

LABELS = {("baseline", "baseline"): "baseline (gunicorn, GET /toxicity)",
          ("toxfleet", "compat"): "toxfleet compat (GET /toxicity)",
          ("toxfleet", "jobs"): "toxfleet jobs (POST /v1/jobs + long-poll)"}

COLORS = {("baseline", "baseline"): "tab:blue", ("toxfleet", "compat"): "tab:orange",
          ("toxfleet", "jobs"): "tab:green"}

TARGETS = {"throughput_vs_baseline": 1.4, "throughput_vs_ceiling": 0.85, "p99_vs_baseline": 0.6,
           "p50_extra_seconds": 0.030}
"""The issue's targets (texts/s ratios, p99 ratio at the highest client count, p50 allowance at 1 client)."""

BOUNDED_GROWTH = 0.2
"""Open loop: called bounded when the requests outstanding grew, over the last window, by at most this
fraction of the requests that arrived in it. Above capacity an unbounded queue keeps growing by
(arrivals - capacity) every window; a bounded one is full and refuses the rest. Only the last window
counts, since the first ones fill the queue up to its bound; accepted p99 is no signal of its own
(requests still waiting at the end are not in it)."""


THROUGHPUT = "norm_texts_per_s"
"""The throughput every comparison uses: tokens answered per second ÷ the corpus's mean tokens per text
(texts/s, token-normalised). Comment lengths are heavy-tailed, so the texts one 8 s window happens to
answer (or the ceiling's sample holds) can be 15 % shorter or longer than the corpus on average;
counting texts would credit a system with that luck. Counted texts/s is reported beside it."""


def normalise(model: dict[str, Any]) -> bool:
    """Add THROUGHPUT to every window and ceiling run: counted texts/s for all of them if any window
    lacks its tokens (results from before they were recorded), so that ratios never mix the two."""
    mean = float(model["tokens"]["mean"])
    runs = [r for cfg in [*model["ceiling"]["configs"], model["ceiling"]["reference"]] for r in cfg["runs"]]
    items = [*windows(model["points"]), *runs]
    tokens = all(item.get("tokens_per_s") is not None for item in items) and mean > 0
    for item in items:
        item[THROUGHPUT] = item["tokens_per_s"] / mean if tokens else item["texts_per_s"]
    return tokens


# -- selecting and summarising ------------------------------------------------------------------

def select(points: Iterable[Point], system: str, mode: str, loop: str, **level: Any) -> list[Point]:
    return [p for p in points if p["system"] == system and p["mode"] == mode and p["loop"] == loop
            and all(p.get(k) == v for k, v in level.items())]


def windows(points: Iterable[Point]) -> list[dict[str, Any]]:
    return [w for p in points for w in p["windows"]]


def spread(points: Iterable[Point], key: str) -> Spread:
    return Spread.of([float(w[key]) for w in windows(points)])


def cpu_spread(points: Iterable[Point], key: str) -> Spread:
    return Spread.of([w["cpu"][key] for w in windows(points) if w.get("cpu")])


def total(points: Iterable[Point], outcome: str) -> int:
    return sum(int(w["counts"][outcome]) for w in windows(points))


def ceiling_best(model: dict[str, Any]) -> tuple[str, Spread, Spread]:
    """(label, texts/s, useful GFLOP/s) of the best ceiling configuration."""
    c = model["ceiling"]
    best = next(cfg for cfg in c["configs"] if cfg["config"]["label"] == c["best"])
    return (c["best"], Spread.of([r[THROUGHPUT] for r in best["runs"]]),
            Spread.of([r["useful_gflops"] for r in best["runs"]]))


# -- formatting ---------------------------------------------------------------------------------

def fmt_num(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def fmt_s(x: float) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_spread(s: Spread, fmt: Callable[[float], str] = fmt_num) -> str:
    if s.n == 0 or math.isnan(s.median):
        return "n/a"
    if s.n == 1 or s.low == s.high:
        return fmt(s.median)
    return f"{fmt(s.median)} ({fmt(s.low)}–{fmt(s.high)})"


def fmt_ratio(s: Spread) -> str:
    return fmt_spread(s, lambda x: f"{x:.2f}×")


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
