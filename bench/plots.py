"""The report's PNG plots, one model each: throughput and p99 vs clients, latency CDFs, token lengths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.points import COLORS, LABELS, SERIES, THROUGHPUT, ceiling_best, select, spread, windows
from bench.stats import cdf_points


def plots(name: str, model: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Throughput and p99 vs clients, latency CDFs, token lengths; returns {kind: png path}."""
    # Imported here, not at the top: matplotlib is slow to load and only the plots need it.
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    pts = model["points"]
    clients = model["profile"]["clients"]
    files: dict[str, Path] = {}

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for system, mode in SERIES:
        xs, med, lo, hi, p99, p99lo, p99hi = [], [], [], [], [], [], []
        for c in clients:
            sel = select(pts, system, mode, "closed", clients=c)
            if not sel:
                continue
            t, p = spread(sel, THROUGHPUT), spread(sel, "p99")
            xs.append(c)
            med.append(t.median)
            lo.append(t.median - t.low)
            hi.append(t.high - t.median)
            p99.append(p.median)
            p99lo.append(p.median - p.low)
            p99hi.append(p.high - p.median)
        if xs:
            style = {"marker": "o", "capsize": 3, "label": LABELS[(system, mode)], "color": COLORS[(system, mode)]}
            ax1.errorbar(xs, med, yerr=[lo, hi], **style)
            ax2.errorbar(xs, p99, yerr=[p99lo, p99hi], **style)
    _, ceil, _ = ceiling_best(model)
    ax1.axhline(ceil.median, color="grey", linestyle="--", label="raw model ceiling")
    for ax, title, ylabel in ((ax1, "Throughput (closed loop)", "texts/s"), (ax2, "p99 latency (closed loop)", "s")):
        ax.set_xscale("log")
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {name}")
        ax.grid(True, alpha=0.3)
    ax1.set_ylim(bottom=0)
    ax2.set_yscale("log")
    _plain_log_axis(ax2.yaxis)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    files["scaling"] = out_dir / f"{name}-scaling.png"
    fig.savefig(files["scaling"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    top = max(clients)
    panels = [(axes[0], "closed", {"clients": top}, f"closed loop, {top} clients")]
    if model["profile"]["open_loads"]:
        over = max(model["profile"]["open_loads"])
        panels.append((axes[1], "open", {"load": over}, f"open loop, {over:.0%} of capacity"))
    else:
        panels.append((axes[1], "closed", {"clients": min(clients)}, f"closed loop, {min(clients)} client(s)"))
    for ax, loop, level, title in panels:
        for system, mode in SERIES:
            lat = [x for w in windows(select(pts, system, mode, loop, **level)) for x in w["latencies"]]
            if lat:
                xy = cdf_points(lat)
                ax.plot([x for x, _ in xy], [y for _, y in xy], label=LABELS[(system, mode)],
                        color=COLORS[(system, mode)])
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"Latency CDF, {title}, {name}", fontsize=9)
        ax.grid(True, alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    files["cdf"] = out_dir / f"{name}-latency-cdf.png"
    fig.savefig(files["cdf"], dpi=110)
    plt.close(fig)

    lengths = model.get("token_lengths") or []
    if lengths:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.hist(lengths, bins=range(0, 530, 16), color="tab:blue")
        ax.set_xlabel("tokens per text (model tokenizer, 512 = truncated)")
        ax.set_ylabel("texts")
        ax.set_title(f"Corpus token lengths ({len(lengths)} texts), {name}", fontsize=9)
        fig.tight_layout()
        files["tokens"] = out_dir / f"{name}-tokens.png"
        fig.savefig(files["tokens"], dpi=110)
        plt.close(fig)
    return files


def _plain_log_axis(axis: Any) -> None:
    """Label a log axis at 1-2-5 steps as plain numbers (decades alone leave a short range unlabelled)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())
