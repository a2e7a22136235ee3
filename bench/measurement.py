"""What one measurement window and one measurement point record, as plain JSON-able dicts.

A *point* is one system under one load (say toxfleet `jobs` at 100 clients); it holds several
*windows*, consecutive equal stretches of the same steady load, and each window yields one value of
every figure. The report prints the median of the windows with their range, so a figure's spread is
visible next to it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cpu import CpuUse
from bench.load import DROPPED, ERROR, OK, OUTCOMES, REFUSED, TIMEOUT, Sample
from bench.stats import percentile

BATCH_LINE = re.compile(r"batch (?P<id>\S+): requests=(?P<requests>\d+) texts=(?P<texts>\d+) passes=(?P<passes>\d+) "
                        r"tokens=(?P<tokens>\d+) padded=(?P<padded>\d+) seconds=(?P<seconds>[\d.]+)")
"""The worker's per-batch log line (worker/tasks.py)."""


def window_figures(samples: Sequence[Sample], seconds: float, cpu: CpuUse | None,
                   answered: Sequence[Sample] | None = None, tokens: Sequence[int] | None = None) -> dict[str, Any]:
    """Throughput, latency percentiles and outcome counts of one window.

    Latency percentiles cover answered requests *and* timeouts (at the time they were given up), so a
    service that stops answering cannot look fast by losing its slowest requests; refusals (429) are
    fast by design and get their own percentile. Throughput counts `answered` (the successful
    answers that arrived in the window), by default the successful answers among `samples`: as texts
    per second, and, given `tokens` (the corpus's token length per text), as tokens per second.
    """
    counts = {o: 0 for o in OUTCOMES}
    for s in samples:
        counts[s.outcome] += 1
    latencies = [s.latency for s in samples if s.outcome in (OK, TIMEOUT)]
    refused = [s.latency for s in samples if s.outcome == REFUSED]
    done = [s for s in (samples if answered is None else answered) if s.outcome == OK]
    return {
        "seconds": seconds,
        "texts_per_s": len(done) / seconds if seconds > 0 else 0.0,
        "tokens_per_s": (sum(tokens[s.index] for s in done) / seconds if tokens is not None and seconds > 0
                         else None),
        "p50": percentile(latencies, 50), "p90": percentile(latencies, 90), "p99": percentile(latencies, 99),
        "counts": counts,
        "errors": counts[ERROR] + counts[TIMEOUT],
        "refused_p99": percentile(refused, 99),
        "cpu": cpu.as_dict() if cpu else None,
        "latencies": [round(x, 4) for x in latencies],
        "statuses": _statuses(samples),
    }


def _statuses(samples: Sequence[Sample]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        if s.outcome not in (OK, DROPPED):
            key = f"{s.outcome}:{s.status}"
            out[key] = out.get(key, 0) + 1
    return out


def batch_summary(log: Path, start: int, end: int | None = None) -> dict[str, Any]:
    """What the worker's batch log lines between byte offsets `start` and `end` say about batching."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read(None if end is None else max(0, end - start)).decode(errors="replace")
    except OSError:
        return {"batches": 0}
    rows = [m.groupdict() for m in BATCH_LINE.finditer(text)]
    if not rows:
        return {"batches": 0}
    n = len(rows)
    total = {k: sum(float(r[k]) for r in rows) for k in ("requests", "texts", "passes", "tokens", "padded", "seconds")}
    texts = sorted(int(r["texts"]) for r in rows)
    return {
        "batches": n,
        "texts_per_batch_mean": total["texts"] / n,
        "texts_per_batch_p50": percentile(texts, 50),
        "texts_per_batch_max": texts[-1],
        "texts_per_pass_mean": total["texts"] / total["passes"] if total["passes"] else 0.0,
        "padding_efficiency": total["tokens"] / total["padded"] if total["padded"] else 0.0,
        "model_seconds": total["seconds"],
    }


def log_size(log: Path | None) -> int:
    try:
        return log.stat().st_size if log else 0
    except OSError:
        return 0
