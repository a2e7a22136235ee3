"""Priority lanes under a bulk backfill: `python -m bench.lanes` (`make bench-lanes`).

Issue 13's target: while a bulk backfill keeps the fleet saturated, interactive p99 at 10 clients
stays within 2x its p99 on an idle fleet. One run starts a private Redis and toxfleet as
`bench.services.start_toxfleet` does (one API, one worker with a process per core, score cache off),
then `--repeats` times, on the same processes:

1. **idle**: `--clients` closed-loop clients each submit a 1-text interactive job (`POST /v1/jobs`,
   the default priority, then long-poll its `Location`: `bench.load`'s `jobs` mode), measured over
   `--windows` windows after a warm-up;
2. **backfill**: the same load while `--backfill-jobs` bulk jobs of `--bulk-texts` texts each
   (`"priority": "bulk"`) are kept in flight, a new one submitted as soon as one finishes, so the
   backlog never empties (checked: the backlog at every window edge is reported);
3. the backfill stops, its jobs in flight are deleted, and the fleet drains before the next repeat.

Each repeat gives p50 and p99 of both phases and their ratio (backfill / idle, same repeat); the
report gives the median and range over repeats. The default checkpoint is the synthetic full-size
`unbiased-small` (ALBERT-base): inference dominates there, as in production, so a bulk batch already
running when an interactive job arrives is what the lane cannot take back; on `tiny` inference is
nearly free, and the figure would measure the serving path's CPU contention instead (`--quick`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from bench import load
from bench.roofline import usable_cores
from bench.services import start_redis, start_toxfleet
from bench.stats import Spread, percentile
from fleet.corpus import DEFAULT_SEED, CommentCorpus
from fleet.queue import read_backlog
from testing import synthetic_checkpoint
from testing.processes import reap_on_term
from toxfleet.contract import BULK

TARGET_RATIO = 2.0
"""Issue 13: interactive p99 under a saturating backfill at most this many times its idle p99."""

DRAIN_TIMEOUT = 180.0
"""Longest wait for the fleet to finish (or skip) the backfill's deleted jobs between repeats."""


def log(msg: str) -> None:
    print(f"[lanes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Backfill:
    """Keeps `jobs` bulk jobs of `texts` each in flight until stopped; counts the texts scored (from
    each job's `progress`, so a backfill that advances without finishing a job in a window counts)."""

    url: str
    corpus: list[str]
    jobs: int
    texts: int
    done_texts: int = 0
    refused: int = 0
    errors: int = 0
    in_flight: set[str] = field(default_factory=set)

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._submitter(http, stop, i) for i in range(self.jobs)))

    async def _submitter(self, http: aiohttp.ClientSession, stop: asyncio.Event, i: int) -> None:
        n = 0
        while not stop.is_set():
            start = (i * 7919 + n * self.texts) % len(self.corpus)
            texts = [self.corpus[(start + k) % len(self.corpus)] for k in range(self.texts)]
            n += 1
            async with http.post(f"{self.url}/v1/jobs", json={"texts": texts, "priority": BULK}) as resp:
                body = await resp.json(content_type=None)
                if resp.status == 429:
                    self.refused += 1
                    await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                    continue
                if resp.status != 202:
                    self.errors += 1
                    await asyncio.sleep(load.FAILURE_PAUSE)
                    continue
            job_id = body["id"]
            self.in_flight.add(job_id)
            counted = 0  # texts of this job already counted: progress counts while the job runs
            while not stop.is_set():
                async with http.get(f"{self.url}/v1/jobs/{job_id}", params={"wait": "1"}) as resp:
                    job = await resp.json(content_type=None)
                status = job.get("status")
                done = int((job.get("progress") or {}).get("done") or 0)
                self.done_texts += max(0, done - counted)
                counted = max(counted, done)
                if status in ("succeeded", "failed"):
                    self.in_flight.discard(job_id)
                    self.errors += status == "failed"
                    break

    async def delete_in_flight(self, http: aiohttp.ClientSession) -> int:
        """Forget the jobs still in flight (the workers skip their texts not yet scored)."""
        ids, self.in_flight = list(self.in_flight), set()
        for job_id in ids:
            async with http.delete(f"{self.url}/v1/jobs/{job_id}") as resp:
                await resp.read()
        return len(ids)


def phase_figures(run: load.LoadRun, backlog: list[int]) -> dict[str, Any]:
    """p50/p99 of the interactive jobs that ended inside the windows (a timeout counts, at the
    deadline: dropping it would flatter the tail), outcomes, the backlog at the window edges."""
    samples = [s for k in range(len(run.boundaries) - 1) for s in load.in_window(run, k, "end")]
    latencies = [s.latency for s in samples if s.outcome in (load.OK, load.TIMEOUT)]
    outcomes = {o: sum(1 for s in samples if s.outcome == o) for o in load.OUTCOMES}
    span = run.boundaries[-1] - run.boundaries[0]
    ok = outcomes[load.OK]
    return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "max": max(latencies, default=math.nan),
            "jobs": ok, "jobs_per_s": ok / span if span else math.nan,
            "outcomes": outcomes, "backlog_at_edges": backlog}


async def measure_phase(url: str, corpus: list[str], args: argparse.Namespace, client: redis.Redis,
                        backfill: Backfill | None) -> dict[str, Any]:
    backlog: list[int] = []

    def probe() -> None:
        backlog.append(read_backlog(client).total)

    async with load.session(args.clients + args.backfill_jobs) as http:
        stop = asyncio.Event()
        filler = None
        if backfill is not None:
            filler = asyncio.create_task(backfill.run(http, stop))
            started = time.monotonic()
            # Saturated: more bulk messages outstanding than processes to score them.
            while read_backlog(client).total <= args.concurrency:
                if time.monotonic() - started > 60 or filler.done():
                    raise RuntimeError("the backfill does not fill the fleet's backlog")
                await asyncio.sleep(0.1)
        texts_before = backfill.done_texts if backfill is not None else 0
        t0 = time.monotonic()
        caller = load.Caller(http, url, "jobs")
        run = await load.closed_loop(caller, corpus, args.clients, args.warmup, args.windows, args.window,
                                     probe, ramp=0.5)
        figures = phase_figures(run, backlog)
        if backfill is not None and filler is not None:
            figures["bulk_texts_per_s"] = (backfill.done_texts - texts_before) / (time.monotonic() - t0)
            stop.set()
            filler.cancel()
            await asyncio.gather(filler, return_exceptions=True)
            figures["bulk_jobs_deleted"] = await backfill.delete_in_flight(http)
            figures["bulk_refused"], figures["bulk_errors"] = backfill.refused, backfill.errors
        if caller.failures:
            figures["failures"] = dict(caller.failures)
    return figures


def drain(client: redis.Redis) -> float:
    started = time.monotonic()
    while read_backlog(client).total:
        if time.monotonic() - started > DRAIN_TIMEOUT:
            raise RuntimeError(f"the fleet did not drain in {DRAIN_TIMEOUT:.0f}s")
        time.sleep(0.2)
    return time.monotonic() - started


def summary(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(phase: str, key: str) -> dict[str, float | int]:
        return Spread.of([r[phase][key] for r in repeats]).as_dict()

    ratios = [r["backfill"]["p99"] / r["idle"]["p99"] for r in repeats]
    return {"idle_p50": spread("idle", "p50"), "idle_p99": spread("idle", "p99"),
            "backfill_p50": spread("backfill", "p50"), "backfill_p99": spread("backfill", "p99"),
            "p99_ratio": Spread.of(ratios).as_dict(), "p99_ratios": ratios,
            "bulk_texts_per_s": spread("backfill", "bulk_texts_per_s"),
            "target_ratio": TARGET_RATIO, "met": Spread.of(ratios).median <= TARGET_RATIO}


def render(result: dict[str, Any]) -> str:
    s, cfg = result["summary"], result["config"]

    def ms(d: dict[str, float]) -> str:
        return f"{d['median'] * 1000:.0f} ms ({d['low'] * 1000:.0f}-{d['high'] * 1000:.0f})"

    lines = [f"### Priority lanes: interactive latency under a bulk backfill ({cfg['model']}, {cfg['backend']}, "
             f"{cfg['concurrency']} worker processes, {cfg['clients']} clients, {cfg['repeats']} repeats)", "",
             *([f"Settings: {', '.join(cfg['env'])}.", ""] if cfg.get("env") else []),
             "| phase | p50 | p99 | interactive jobs/s | not ok (timeout, error, 429) | bulk texts/s | "
             "backlog at window edges (min) |",
             "|---|---|---|---|---|---|---|"]
    for r_i, rep in enumerate(result["repeats"], 1):
        for phase in ("idle", "backfill"):
            f = rep[phase]
            bulk = f"{f['bulk_texts_per_s']:.1f}" if "bulk_texts_per_s" in f else "-"
            bad = sum(n for o, n in f["outcomes"].items() if o != load.OK)
            lines.append(f"| {r_i}. {phase} | {f['p50'] * 1000:.0f} ms | {f['p99'] * 1000:.0f} ms | "
                         f"{f['jobs_per_s']:.1f} | {bad} | {bulk} | {min(f['backlog_at_edges'], default=0)} |")
    lines += ["", f"Idle p99 {ms(s['idle_p99'])}, under the backfill {ms(s['backfill_p99'])} (median, range); "
              f"p99 ratio backfill / idle, per repeat: {', '.join(f'{x:.2f}' for x in s['p99_ratios'])}, "
              f"median **{s['p99_ratio']['median']:.2f}x** (target <= {TARGET_RATIO:.0f}x: "
              f"{'met' if s['met'] else 'not met'})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    reap_on_term()  # a killed run (timeout, kill) takes its servers with it
    load.raise_open_files_limit()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="unbiased-small", help="synthetic checkpoint kind (tiny, unbiased-small...)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--backfill-jobs", type=int, default=8, help="bulk jobs kept in flight")
    parser.add_argument("--bulk-texts", type=int, default=64, help="texts per bulk job")
    parser.add_argument("--concurrency", type=int, default=usable_cores(), help="worker processes")
    parser.add_argument("--backend", default="torch", help="TOXFLEET_BACKEND of the worker (torch: the reference)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the API and the worker, e.g. TOXFLEET_BATCH_TOKENS=1024 (repeatable)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 repeats of 2 x 2 s windows")
    parser.add_argument("--json", type=Path, default=Path("var/bench-lanes.json"))
    parser.add_argument("--report", type=Path, default=Path("var/bench-lanes.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.repeats, args.warmup, args.windows, args.window = "tiny", 2, 1.0, 2, 2.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the services it started
    ckpt, hf = synthetic_checkpoint(args.model)
    corpus = CommentCorpus(args.seed).texts(2000)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    redis_service, redis_url = start_redis(log_dir)
    repeats: list[dict[str, Any]] = []
    text = ""
    try:
        extra = dict(kv.split("=", 1) for kv in args.env)
        service, url = start_toxfleet(ckpt, hf, args.concurrency, redis_url, log_dir,
                                      {"TOXFLEET_BACKEND": args.backend, **extra})
        with service:
            client = redis.Redis.from_url(redis_url)
            for i in range(args.repeats):
                idle = asyncio.run(measure_phase(url, corpus, args, client, None))
                log(f"repeat {i + 1}: idle p50 {idle['p50'] * 1000:.0f} ms, p99 {idle['p99'] * 1000:.0f} ms")
                backfill = Backfill(url, corpus, args.backfill_jobs, args.bulk_texts)
                loaded = asyncio.run(measure_phase(url, corpus, args, client, backfill))
                loaded["drain_s"] = drain(client)
                log(f"repeat {i + 1}: backfill p50 {loaded['p50'] * 1000:.0f} ms, p99 {loaded['p99'] * 1000:.0f} ms, "
                    f"bulk {loaded['bulk_texts_per_s']:.1f} texts/s, drained in {loaded['drain_s']:.1f}s")
                repeats.append({"idle": idle, "backfill": loaded})
                text = write(args, repeats)  # after every repeat: a long run stopped early keeps its figures
                service.check_alive()
    finally:
        redis_service.stop()
    print(text)
    return 0


def write(args: argparse.Namespace, repeats: list[dict[str, Any]]) -> str:
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "repeats": repeats, "summary": summary(repeats)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    text = render(result)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
