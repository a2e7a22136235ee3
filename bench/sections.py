"""The report's markdown sections, one model each: the targets checked, the corpus's token lengths, the
raw model ceiling, the closed loop (and its ratios to the baseline) and the open loop."""

from __future__ import annotations

import math
from typing import Any

from bench.points import (
    BOUNDED_GROWTH,
    LABELS,
    SERIES,
    TARGETS,
    THROUGHPUT,
    Point,
    ceiling_best,
    cpu_spread,
    fmt_num,
    fmt_ratio,
    fmt_s,
    fmt_spread,
    select,
    spread,
    table,
    total,
    windows,
)
from bench.stats import Spread, percentile


def targets_section(name: str, model: dict[str, Any], peak: float) -> str:
    pts = model["points"]
    clients = model["profile"]["clients"]
    top, one = max(clients), min(clients)
    bl_top = select(pts, "baseline", "baseline", "closed", clients=top)
    bl_one = select(pts, "baseline", "baseline", "closed", clients=one)
    _, ceil, ceil_gflops = ceiling_best(model)
    own = dict(model["profile"].get("targets") or ())

    def target(name: str, mode: str) -> float | None:
        return own.get(f"{name}/{mode}", own.get(name, TARGETS[name]))

    rows: list[list[str]] = []
    frac = Spread(ceil_gflops.median / peak, ceil_gflops.low / peak, ceil_gflops.high / peak, ceil_gflops.n)
    rows.append(["raw model ceiling (best pass size, no server)", "reported",
                 f"{fmt_spread(ceil)} texts/s = {fmt_spread(ceil_gflops, lambda x: f'{x:.0f}')} GFLOP/s = "
                 f"{fmt_spread(frac, lambda x: f'{x:.0%}')} of peak ({peak:.0f} GFLOP/s)", ""])
    bl_tput = spread(bl_top, THROUGHPUT)
    rows.append([f"baseline texts/s at {top} clients", "reported", fmt_spread(bl_tput), ""])
    for mode in ("jobs", "compat"):
        tf_top = select(pts, "toxfleet", mode, "closed", clients=top)
        tf_one = select(pts, "toxfleet", mode, "closed", clients=one)
        if not tf_top:
            continue
        tput = spread(tf_top, THROUGHPUT)
        r = tput.ratio(bl_tput)
        goal = target("throughput_vs_baseline", mode)
        rows.append([f"toxfleet {mode}: texts/s at {top} clients ÷ baseline", _goal(">=", goal, "{:g}×"),
                     f"{fmt_ratio(r)} ({fmt_num(tput.median)} vs {fmt_num(bl_tput.median)})",
                     _verdict(r.median, ">=", goal)])
        r = tput.ratio(ceil)
        goal = target("throughput_vs_ceiling", mode)
        rows.append([f"toxfleet {mode}: texts/s at {top} clients ÷ raw ceiling", _goal(">=", goal, "{:.0%}"),
                     fmt_spread(r, lambda x: f"{x:.0%}"), _verdict(r.median, ">=", goal)])
        r = spread(tf_top, "p99").ratio(spread(bl_top, "p99"))
        goal = target("p99_vs_baseline", mode)
        rows.append([f"toxfleet {mode}: p99 at {top} clients ÷ baseline", _goal("<=", goal, "{:g}×"),
                     f"{fmt_ratio(r)} ({fmt_s(spread(tf_top, 'p99').median)} vs "
                     f"{fmt_s(spread(bl_top, 'p99').median)})", _verdict(r.median, "<=", goal)])
        if tf_one and bl_one:
            tf50, bl50 = spread(tf_one, "p50"), spread(bl_one, "p50")
            extra = tf50.median - bl50.median
            rows.append([f"toxfleet {mode}: p50 at {one} client − baseline's",
                         f"≤ +{TARGETS['p50_extra_seconds'] * 1000:.0f} ms",
                         f"{extra * 1000:+.0f} ms ({fmt_s(tf50.median)} vs {fmt_s(bl50.median)})",
                         _verdict(extra, "<=", TARGETS["p50_extra_seconds"])])
    loads = model["profile"]["open_loads"]
    if loads:
        over = max(loads)
        for system, mode in SERIES:
            ol = select(pts, system, mode, "open", load=over)
            if not ol:
                continue
            by_window = [w["p99"] for w in windows(ol)]
            outstanding = [n for p in ol for n in p.get("outstanding", [])]
            growth = _growth(outstanding, ol[-1]["rate"] * windows(ol)[-1]["seconds"])
            if total(ol, "timeout"):
                growth = math.inf
            verdict = _verdict(growth, "<=", BOUNDED_GROWTH) if not math.isnan(growth) else "n/a (one window)"
            refused = total(ol, "refused")
            refused_p99 = max((w["refused_p99"] for w in windows(ol) if not math.isnan(w["refused_p99"])),
                              default=math.nan)
            rows.append([f"{system} {mode}: open loop at {over:.0%} of its capacity", "bounded p99, fast 429",
                         f"accepted p99 by window {' → '.join(fmt_s(x) for x in by_window)}; requests outstanding "
                         f"at window edges {' → '.join(str(n) for n in outstanding)} (bound seen: "
                         f"{fmt_s(max(by_window))}); errors {total(ol, 'error')}; timeouts {total(ol, 'timeout')}; "
                         f"refused {refused}" + (f" (p99 {fmt_s(refused_p99)})" if refused else ""),
                         verdict if system == "toxfleet" else ""])
    return table(["figure", "target", "measured: median (range)", ""], rows)


def _growth(outstanding: list[int], arrivals: float) -> float:
    """How much the queue grew over the last window, as a fraction of the requests that arrived in it."""
    if len(outstanding) < 2 or not arrivals > 0:
        return math.nan
    return (outstanding[-1] - outstanding[-2]) / arrivals


def _goal(op: str, target: float | None, spelling: str) -> str:
    return "reported" if target is None else f"{'≥' if op == '>=' else '≤'} {spelling.format(target)}"


def _verdict(value: float, op: str, target: float | None) -> str:
    if target is None:
        return ""
    if math.isnan(value):
        return "n/a"
    ok = value >= target if op == ">=" else value <= target
    return "met" if ok else "**not met**"


def tokens_section(model: dict[str, Any]) -> str:
    t = model["tokens"]
    keys = ["count", "mean", "min", "p10", "p25", "p50", "p75", "p90", "p99", "max"]
    trunc = sum(1 for n in model.get("token_lengths", []) if n >= 512)
    return (table(keys + ["at 512 (truncated)"], [[fmt_num(t.get(k, math.nan), 0 if k == "count" else 1) for k in keys]
                                                   + [str(trunc)]]))


def ceiling_section(model: dict[str, Any], peak: float) -> str:
    c = model["ceiling"]
    rows = []
    for cfg in [*c["configs"], c["reference"]]:
        runs = cfg["runs"]
        if not runs:
            continue
        tput = Spread.of([r[THROUGHPUT] for r in runs])
        counted = Spread.of([r["texts_per_s"] for r in runs])
        useful = Spread.of([r["useful_gflops"] for r in runs])
        executed = Spread.of([r["executed_gflops"] for r in runs])
        label = cfg["config"]["label"] + (" **(best)**" if cfg["config"]["label"] == c["best"] else "")
        other = Spread.of([r["cpu"]["other"] for r in runs if r.get("cpu")])
        tokens = Spread.of([r["tokens_per_s"] for r in runs])
        rows.append([label, str(len(runs)), fmt_spread(tput), fmt_spread(counted),
                     fmt_spread(tokens, lambda x: f"{x:.0f}"), fmt_spread(useful, lambda x: f"{x:.1f}"),
                     f"{useful.median / peak:.1%}", fmt_num(executed.median, 1), fmt_spread(other)])
    return table(["configuration", "runs", "texts/s (token-normalised)", "texts/s (counted)", "tokens/s",
                  "useful GFLOP/s", "of peak", "executed GFLOP/s", "other CPU (cores)"], rows)


def closed_section(model: dict[str, Any]) -> str:
    pts = model["points"]
    rows = []
    for system, mode in SERIES:
        for clients in model["profile"]["clients"]:
            sel = select(pts, system, mode, "closed", clients=clients)
            if sel:
                rows.append(_row(LABELS[(system, mode)], str(clients), sel))
    return table(["system", "clients", "texts/s (token-normalised)", "texts/s (counted)", "p50", "p90", "p99",
                  "errors", "service CPU (cores)", "load generator / other CPU", "worker batches"], rows)


ROLE_ORDER = ("server", "api", "worker main", "pool", "redis")
"""Columns of the CPU-per-job table: the baseline's Gunicorn tree, then toxfleet's processes."""


def cpu_per_job_section(model: dict[str, Any]) -> str:
    """CPU milliseconds per request (one-text jobs: per text) of each process, closed loop: a window's
    cores used ÷ its texts answered per second, median over windows (range in brackets)."""
    pts = model["points"]
    rows = []
    for system, mode in SERIES:
        for clients in model["profile"]["clients"]:
            ws = [w for w in windows(select(pts, system, mode, "closed", clients=clients))
                  if w.get("cpu") and w["texts_per_s"] > 0]
            if not ws:
                continue
            total = Spread.of([1000 * w["cpu"]["service"] / w["texts_per_s"] for w in ws])
            per_role = [Spread.of([1000 * w["cpu"].get("roles", {}).get(role, math.nan) / w["texts_per_s"]
                                   for w in ws]) for role in ROLE_ORDER]
            rows.append([LABELS[(system, mode)], str(clients), fmt_spread(spread_of(ws, "texts_per_s")),
                         fmt_spread(total), *(fmt_spread(r) if r.n else "" for r in per_role)])
    return table(["system", "clients", "texts/s", "service CPU ms per request", *(f"{r} ms" for r in ROLE_ORDER)],
                 rows)


def spread_of(ws: list[dict[str, Any]], key: str) -> Spread:
    return Spread.of([float(w[key]) for w in ws])


def ratio_section(model: dict[str, Any]) -> str:
    pts = model["points"]
    rows = []
    for clients in model["profile"]["clients"]:
        bl = select(pts, "baseline", "baseline", "closed", clients=clients)
        for mode in ("compat", "jobs"):
            tf = select(pts, "toxfleet", mode, "closed", clients=clients)
            if bl and tf:
                rows.append([mode, str(clients),
                             fmt_ratio(spread(tf, THROUGHPUT).ratio(spread(bl, THROUGHPUT))),
                             fmt_ratio(spread(tf, "p50").ratio(spread(bl, "p50"))),
                             fmt_ratio(spread(tf, "p99").ratio(spread(bl, "p99")))])
    return table(["toxfleet mode", "clients", "texts/s ÷ baseline", "p50 ÷ baseline", "p99 ÷ baseline"], rows)


def open_section(model: dict[str, Any]) -> str:
    pts = model["points"]
    rows = []
    for system, mode in SERIES:
        for fraction in model["profile"]["open_loads"]:
            sel = select(pts, system, mode, "open", load=fraction)
            if not sel:
                continue
            rate = sel[0]["rate"]
            row = _row(LABELS[(system, mode)], f"{fraction:.0%} ({rate:.1f}/s)", sel)
            by_window = " → ".join(fmt_s(w["p99"]) for w in windows(sel))
            outstanding = " → ".join(str(n) for p in sel for n in p.get("outstanding", []))
            refused = total(sel, "refused")
            refused_p99 = percentile([w["refused_p99"] for w in windows(sel) if not math.isnan(w["refused_p99"])], 50)
            row[7] = (f"{total(sel, 'error')} / {total(sel, 'timeout')} / {refused}"
                      + (f" ({fmt_s(refused_p99)})" if refused else "") + f" / {total(sel, 'dropped')}")
            rows.append([*row[:7], by_window, outstanding, *row[7:]])
    return table(["system", "arrival rate", "texts/s answered (token-normalised)", "texts/s answered (counted)",
                  "p50", "p90", "p99", "p99 by window",
                  "outstanding at window edges",
                  "errors / timeouts / refused (p99) / dropped", "service CPU (cores)",
                  "load generator / other CPU", "worker batches"], rows)


def _row(label: str, level: str, sel: list[Point]) -> list[str]:
    errors = total(sel, "error") + total(sel, "timeout")
    b = [p["batches"] for p in sel if p.get("batches") and p["batches"].get("batches")]
    batches = ""
    if b:
        n = sum(x["batches"] for x in b)
        per_batch = sum(x["texts_per_batch_mean"] * x["batches"] for x in b) / n
        per_pass = sum(x["texts_per_pass_mean"] for x in b) / len(b)
        eff = sum(x["padding_efficiency"] for x in b) / len(b)
        batches = f"{n}: {per_batch:.1f} texts/batch, {per_pass:.1f}/pass, {eff:.0%} real tokens"
    return [label, level, fmt_spread(spread(sel, THROUGHPUT)), fmt_spread(spread(sel, "texts_per_s")),
            fmt_spread(spread(sel, "p50"), fmt_s),
            fmt_spread(spread(sel, "p90"), fmt_s), fmt_spread(spread(sel, "p99"), fmt_s), str(errors),
            fmt_spread(cpu_spread(sel, "service")),
            f"{fmt_num(cpu_spread(sel, 'client').median)} / {fmt_num(cpu_spread(sel, 'other').median)}", batches]
