"""A soak: the fleet under steady load for minutes, with a bulk backfill and workers killed -9.

    python -m bench.soak --minutes 15      # `make soak`; --minutes 3 for a look

It starts a private Redis (AOF, as shipped), the API and two workers (`--concurrency` pool processes
each) on a synthetic checkpoint, measures the fleet's capacity with a short closed loop, then offers
`--load` (80 %) of it as an open loop of jobs of mixed sizes (1, 4 or 16 texts) through the official
client, while a bulk backfill (`Client.score` over `--backfill` texts) runs alongside from a third of
the way in, and a worker is killed -9 every `--kill-every` seconds and replaced (always the second
worker: the first, w0, lives through the whole run, so its RSS slope covers all of it). Every 5 s it samples
each worker process's RSS and Redis's memory and key count. At the end it reports, to stdout and
var/soak.json, with plots in docs/soak-*.png:

- RSS per worker process: slope after warm-up (the first fifth) and growth over that time, in %, and
  the memory verdict: each process that lived `--rss-min-minutes` after its warm-up passes if its
  slope stays within `--rss-bound` (% of its size per hour), else the soak fails;
- Redis used memory and key count over time (every key expires or is bounded: the count levels off);
- p99 job latency per minute (submit to final answer);
- lost (a job whose wait raised), rescored (requests the workers scored more than once, from their
  own execution record: expected after kills, at least once) and changed (a request published final
  twice with different outcomes, by the observer).

Exit status 1 if a job was lost, a result changed, or a process failed the memory verdict.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import load
from bench.stats import percentile
from fleet.corpus import CommentCorpus
from testing import ROOT, Proc, RedisServer, child_pids, free_port, start_api, start_worker, synthetic_checkpoint
from testing.faults import ExecutionLog, ResultObserver
from testing.processes import reap_on_term
from testing.services import execution_log
from toxfleet.client import Client

SIZES = (1, 1, 1, 4, 4, 16)
"""Texts per job, drawn uniformly: most jobs small, some large."""

SAMPLE_EVERY = 5.0

RSS_BOUND_PCT_PER_HOUR = 5.0
"""Default of `--rss-bound`: the steepest RSS slope after warm-up that passes, in % of the process's
size at warm-up per hour (a 400 MB pool process: 0.33 MB/min). A leak of one request's texts per batch
exceeds it within a 15-minute soak; allocator noise (0.003-0.009 MB/min measured on an 85 MB main
process) stays two orders below it."""

RSS_MIN_MINUTES = 2.0
"""Default of `--rss-min-minutes`: a process with less time after its warm-up (a replacement started
near the end) is listed but not judged: its slope is noise."""


@dataclass
class Soak:
    """What the soak saw."""

    started: float = field(default_factory=time.monotonic)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.started


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def capacity(url: str, texts: list[str], seconds: float) -> float:
    """Texts per second the fleet sustains: a closed loop of 8 callers of 4-text jobs for `seconds`."""
    done = 0
    deadline = time.monotonic() + seconds
    lock = threading.Lock()

    def caller() -> None:
        nonlocal done
        with Client(url) as c:
            while time.monotonic() < deadline:
                c.submit(random.sample(texts, 4)).wait(timeout=120)
                with lock:
                    done += 4

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: caller(), range(8)))
    return done / (time.monotonic() - started)


def offer(soak: Soak, url: str, texts: list[str], rate: float, until: float) -> None:
    """Open loop: Poisson arrivals of jobs at `rate` texts/s until `until` (soak time)."""
    mean_size = statistics.mean(SIZES)
    client = Client(url, stall_after=120)

    def one(size: int, issued: float) -> None:
        row: dict[str, Any] = {"issued": issued, "size": size}
        try:
            client.submit(random.sample(texts, size)).wait(timeout=600)
            row["latency"] = soak.now() - issued
        except Exception as exc:
            row["error"] = repr(exc)
        with soak.lock:
            soak.jobs.append(row)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        next_at = soak.now()
        while soak.now() < until:
            next_at += random.expovariate(rate / mean_size)
            time.sleep(max(0.0, next_at - soak.now()))
            pool.submit(one, random.choice(SIZES), soak.now())
    client.close()


def backfill(soak: Soak, url: str, texts: list[str], out: dict[str, Any]) -> None:
    started = soak.now()
    try:
        with Client(url, stall_after=120) as c:
            results = c.score(texts, job_size=64, in_flight=2)
        out.update(texts=len(texts), results=len(results), seconds=soak.now() - started)
    except Exception as exc:
        out.update(texts=len(texts), error=repr(exc))


def sample(soak: Soak, redis: RedisServer, workers: list[Proc], stop: threading.Event) -> None:
    client = redis.client()
    while not stop.wait(SAMPLE_EVERY):
        row: dict[str, Any] = {"t": soak.now(), "rss": {}}
        for w in list(workers):
            if w.proc is None or not w.alive():
                continue
            for pid in [w.proc.pid, *child_pids(w.proc.pid)]:
                if (mb := rss_mb(pid)) is not None:
                    row["rss"][f"{w.name}:{pid}"] = mb
        try:
            info = client.info("memory")
            row.update(redis_mb=int(info["used_memory"]) / 2**20, keys=int(client.dbsize()))
        except Exception:
            row.update(redis_mb=None, keys=None)
        soak.samples.append(row)


def slope_report(samples: list[dict[str, Any]], warmup: float) -> dict[str, dict[str, float]]:
    """Per process, after its own warm-up (`warmup` seconds from its first sample: a replacement loads
    its model then), with at least three samples left: MB/min (least squares) and growth %."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for proc, mb in s["rss"].items():
            series.setdefault(proc, []).append((s["t"], mb))
    out = {}
    for proc, seen in series.items():
        points = [(t, mb) for t, mb in seen if t >= seen[0][0] + warmup]
        if len(points) < 3:
            continue
        ts, ms = [p[0] for p in points], [p[1] for p in points]
        slope = statistics.linear_regression(ts, ms).slope * 60
        out[proc] = {"mb_start": round(ms[0], 1), "mb_end": round(ms[-1], 1), "mb_per_min": round(slope, 3),
                     "growth_pct": round(100 * (ms[-1] - ms[0]) / ms[0], 2), "minutes": round((ts[-1] - ts[0]) / 60, 1)}
    return out


def memory_verdict(rss: dict[str, dict[str, float]], bound_pct_per_hour: float,
                   min_minutes: float) -> dict[str, Any]:
    """Per process judged: its slope against `bound_pct_per_hour` of its size at warm-up; `passed`
    when every judged process is within it (and at least one was judged)."""
    judged = {}
    for proc, row in rss.items():
        if row["minutes"] < min_minutes:
            continue
        bound = row["mb_start"] * bound_pct_per_hour / 100 / 60
        judged[proc] = {"mb_per_min": row["mb_per_min"], "bound_mb_per_min": round(bound, 4),
                        "passed": row["mb_per_min"] <= bound}
    return {"bound_pct_per_hour": bound_pct_per_hour, "min_minutes": min_minutes, "processes": judged,
            "not_judged": sorted(set(rss) - set(judged)),
            "passed": bool(judged) and all(j["passed"] for j in judged.values())}


def p99_per_minute(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    minutes: dict[int, list[float]] = {}
    for j in jobs:
        if "latency" in j:
            minutes.setdefault(int(j["issued"] // 60), []).append(j["latency"])
    return [{"minute": m, "jobs": len(v), "p50_s": round(percentile(v, 50), 3), "p99_s": round(percentile(v, 99), 3),
             "max_s": round(max(v), 3)}
            for m, v in sorted(minutes.items())]


def unexpiring_keys(client: Any) -> dict[str, int]:
    """Keys without a TTL: each must be bounded by design (queues, the unacked hash, the pending record,
    the workers' heartbeats), never one per job."""
    found: dict[str, int] = {}
    for key in client.scan_iter(count=1000):
        if client.ttl(key) == -1:
            name = key.decode(errors="replace")
            found[name] = found.get(name, 0) + 1
    return found


def plot(report: dict[str, Any], samples: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib  # why: the benchmark's plotting dependency, only needed here at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    procs = sorted({p for s in samples for p in s["rss"]})
    for proc in procs:
        pts = [(s["t"] / 60, s["rss"][proc]) for s in samples if proc in s["rss"]]
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=proc, linewidth=1)
    axes[0].set_ylabel("RSS (MB) per process")
    axes[0].legend(fontsize=6, ncol=2)
    for k in report["kills_min"]:
        for ax in axes:
            ax.axvline(k, color="red", linestyle=":", linewidth=1)
    mem = [(s["t"] / 60, s["redis_mb"], s["keys"]) for s in samples if s["redis_mb"] is not None]
    axes[1].plot([m[0] for m in mem], [m[1] for m in mem], color="tab:purple")
    axes[1].set_ylabel("Redis used memory (MB)")
    twin = axes[1].twinx()
    twin.plot([m[0] for m in mem], [m[2] for m in mem], color="tab:gray")
    twin.set_ylabel("Redis keys")
    rows = report["p99_per_minute"]
    axes[2].plot([r["minute"] + 0.5 for r in rows], [r["p99_s"] for r in rows], marker="o", label="p99")
    axes[2].plot([r["minute"] + 0.5 for r in rows], [r["p50_s"] for r in rows], marker=".", label="p50")
    axes[2].set_ylabel("job latency (s)")
    axes[2].set_xlabel("minutes (red: a worker killed -9)")
    axes[2].legend()
    fig.suptitle(f"soak: {report['minutes']} min at {report['offered_texts_per_s']:.1f} texts/s "
                 f"({int(100 * report['load'])} % of {report['capacity_texts_per_s']:.1f})")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "soak.png"
    fig.savefig(path, dpi=90)
    return [path]


def main(argv: list[str] | None = None) -> int:
    reap_on_term()  # a killed run (timeout, kill) takes its servers with it
    load.raise_open_files_limit()
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--load", type=float, default=0.8, help="share of the measured capacity offered")
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds between worker kills")
    parser.add_argument("--backfill", type=int, default=2000, help="texts in the bulk backfill")
    parser.add_argument("--concurrency", type=int, default=1, help="pool processes per worker")
    parser.add_argument("--model", default="tiny", help="synthetic checkpoint (tools.synthetic kind)")
    parser.add_argument("--json", type=Path, default=ROOT / "var" / "soak.json")
    parser.add_argument("--plots", type=Path, default=ROOT / "docs" / "reliability")
    parser.add_argument("--rss-bound", type=float, default=RSS_BOUND_PCT_PER_HOUR,
                        help="memory verdict: most RSS growth after warm-up, %% of the process's size per hour")
    parser.add_argument("--rss-min-minutes", type=float, default=RSS_MIN_MINUTES,
                        help="memory verdict: judge only processes with this many minutes after warm-up")
    args = parser.parse_args(argv)
    checkpoint = synthetic_checkpoint(args.model)
    texts = CommentCorpus(77).texts(3000)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        redis = RedisServer(free_port(), tmp, appendonly=True)
        redis.start()
        observer = ResultObserver(redis.url)
        observer.start()
        observer.subscribed.wait(5)
        api, url = start_api(tmp, redis.url)
        workers = [start_worker(tmp, redis.url, checkpoint, name=f"w{i}", concurrency=args.concurrency)
                   for i in range(2)]
        stop = threading.Event()
        try:
            cap = capacity(url, texts, 20)
            soak = Soak()
            seconds = args.minutes * 60
            sampler = threading.Thread(target=sample, args=(soak, redis, workers, stop), daemon=True)
            sampler.start()
            bulk: dict[str, Any] = {}
            bulk_thread = threading.Timer(seconds / 3, backfill, args=(soak, url, texts[: args.backfill], bulk))
            bulk_thread.start()
            loader = threading.Thread(target=offer, args=(soak, url, texts, args.load * cap, seconds))
            loader.start()
            next_kill, n = args.kill_every, 0
            while soak.now() < seconds:
                time.sleep(1)
                if soak.now() >= next_kill and soak.now() < seconds - 20:
                    # Always the second slot: w0 lives the whole run, so its RSS slope spans it.
                    victim = workers.pop(1)
                    assert victim.proc is not None
                    os.killpg(victim.proc.pid, signal.SIGKILL)
                    soak.kills.append(soak.now())
                    n += 1
                    workers.append(start_worker(tmp, redis.url, checkpoint, name=f"r{n}",
                                                concurrency=args.concurrency, wait=False))
                    next_kill += args.kill_every
            loader.join()
            bulk_thread.join()
            stop.set()
            unbounded = unexpiring_keys(redis.client())
            rescored = ExecutionLog(execution_log(tmp)).rescored()
        finally:
            stop.set()
            for p in [*workers, api]:
                p.stop()
            observer.stopped.set()
            redis.stop()
    lost = [j for j in soak.jobs if "error" in j]
    report = {"minutes": args.minutes, "load": args.load, "capacity_texts_per_s": round(cap, 2),
              "offered_texts_per_s": round(args.load * cap, 2), "jobs": len(soak.jobs), "lost": len(lost),
              "lost_examples": [j["error"] for j in lost[:3]],
              "rescored": rescored, "changed": len(observer.changed),
              "kills_min": [round(k / 60, 2) for k in soak.kills], "backfill": bulk,
              "keys_without_ttl": unbounded,
              "rss": slope_report(soak.samples, max(30.0, seconds / 5)), "p99_per_minute": p99_per_minute(soak.jobs),
              "redis": [{"t_min": round(s["t"] / 60, 2), "mb": s["redis_mb"] and round(s["redis_mb"], 2),
                         "keys": s["keys"]} for s in soak.samples[:: max(1, len(soak.samples) // 20)]]}
    report["memory"] = memory_verdict(report["rss"], args.rss_bound, args.rss_min_minutes)
    report["plots"] = [str(p.relative_to(ROOT)) for p in plot(report, soak.samples, args.plots)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**report, "samples": soak.samples}, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    verdict = report["memory"]
    print(f"MEMORY {'PASS' if verdict['passed'] else 'FAIL'}: RSS slope within {args.rss_bound:g} %/h for "
          f"{sum(j['passed'] for j in verdict['processes'].values())} of {len(verdict['processes'])} processes "
          f"judged ({len(verdict['not_judged'])} lived under {args.rss_min_minutes:g} min after warm-up)")
    return 0 if not lost and report["changed"] == 0 and verdict["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
