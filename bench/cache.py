"""What the score cache buys on repetitive traffic, and how fast the CLI bulk-scores.

One run starts a private Redis and two identical fleets (a worker and an API each) on two Redis
databases, one with the score cache off and one with it on, so both are measured side by side on
the same machine, corpus and checkpoint. Each repeat, in alternating order, runs the real
`toxfleet score` CLI over the same JSONL corpus against each fleet and times it:

- `off`: cache off: the CLI's bulk-scoring rate;
- `on, cold`: cache on but emptied first: only repeats *within* the corpus hit (those whose first
  occurrence was already scored when they were looked up);
- `on, warm`: the same corpus again right after (back-scoring a file twice, or a spam wave): every
  text hits and the API answers each job without a worker.

The corpus is `CommentCorpus(duplicate_rate=...)`: that fraction of comments repeats an earlier one
exactly (default 30 %, a spam/copy-paste-heavy forum). Reported: median rows/s with min-max over the
repeats, the cache hit fraction, and the ratios to `off`. On a shared CPU the figures are indicative.

    python -m bench.cache --checkpoint models/unbiased-small/model.ckpt --hf models/unbiased-small/hf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from fleet import cache as score_cache
from fleet import keys
from fleet.corpus import CommentCorpus
from testing import RedisServer, base_env, free_port, start_api, start_worker
from testing.processes import reap_on_term

TOXFLEET = str(Path(sys.executable).parent / "toxfleet")


def _clear_cache(client: redis.Redis) -> None:
    found = list(client.scan_iter(match=keys.CACHE_PREFIX + "*", count=1000))
    for i in range(0, len(found), 1000):
        client.delete(*found[i: i + 1000])


def _run_cli(url: str, src: Path, out: Path, env: dict[str, str], job_size: int, in_flight: int) -> float:
    """Seconds the CLI takes to score the whole file (from scratch)."""
    started = time.perf_counter()
    done = subprocess.run([TOXFLEET, "score", str(src), "-o", str(out), "--url", url, "--overwrite", "--no-progress",
                           "--job-size", str(job_size), "--in-flight", str(in_flight)],
                          env=env, capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the CLI failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def _summary(rates: list[float]) -> dict[str, float]:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def main(argv: list[str] | None = None) -> int:
    reap_on_term()  # a killed run (timeout, kill) takes its servers with it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("models/unbiased-small/model.ckpt"))
    parser.add_argument("--hf", type=Path, default=None, help="HF config dir (default: next to the checkpoint)")
    parser.add_argument("--texts", type=int, default=400, help="rows in the corpus (default %(default)s)")
    parser.add_argument("--duplicate-rate", type=float, default=0.3, help="default %(default)s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=len(os.sched_getaffinity(0)),
                        help="worker processes per fleet (default: the CPUs available)")
    parser.add_argument("--job-size", type=int, default=64, help="CLI rows per job (default %(default)s)")
    parser.add_argument("--in-flight", type=int, default=8, help="CLI jobs in flight (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    checkpoint = (args.checkpoint.resolve(), (args.hf or args.checkpoint.parent / "hf").resolve())
    if not checkpoint[0].is_file():
        raise SystemExit(f"no checkpoint at {checkpoint[0]} (python -m tools.synthetic unbiased-small --out models)")

    texts = CommentCorpus(duplicate_rate=args.duplicate_rate).texts(args.texts)
    distinct = len(set(texts))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "corpus.jsonl"
        src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
        server = RedisServer(free_port(), tmp)
        server.start()
        procs = []
        try:
            fleets: dict[str, dict[str, Any]] = {}
            for db, (name, cache) in enumerate((("off", "false"), ("on", "true")), start=1):
                url = server.db_url(db)
                worker = start_worker(tmp, url, checkpoint, name=f"bench-{name}", concurrency=args.concurrency,
                                      env={"TOXFLEET_CACHE": cache})
                api, api_url = start_api(tmp, url, name=f"bench-api-{name}", TOXFLEET_CACHE=cache)
                procs += [worker, api]
                fleets[name] = {"redis": redis.Redis.from_url(url), "url": api_url, "env": base_env(url, None)}
            rates: dict[str, list[float]] = {"off": [], "on, cold": [], "on, warm": []}
            hits: list[float] = []
            order = ["off", "on"]
            for repeat in range(args.repeats):
                for name in order if repeat % 2 == 0 else order[::-1]:
                    fleet = fleets[name]
                    out = tmp / f"out-{name}.jsonl"
                    if name == "off":
                        rates["off"].append(args.texts / _run_cli(fleet["url"], src, out, fleet["env"],
                                                                  args.job_size, args.in_flight))
                        continue
                    _clear_cache(fleet["redis"])
                    cold = _run_cli(fleet["url"], src, out, fleet["env"], args.job_size, args.in_flight)
                    hits.append(score_cache.ScoreCache(fleet["redis"]).stats()["hits"] / args.texts)
                    warm = _run_cli(fleet["url"], src, out, fleet["env"], args.job_size, args.in_flight)
                    rates["on, cold"].append(args.texts / cold)
                    rates["on, warm"].append(args.texts / warm)
                print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} rows/s"
                                                                           for k, v in rates.items()), flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
            server.stop()

    summary = {k: _summary(v) for k, v in rates.items()}
    base = summary["off"]["median"]
    print(f"\ncorpus: {args.texts} comments, duplicate_rate={args.duplicate_rate} ({distinct} distinct, "
          f"{1 - distinct / args.texts:.0%} repeats); checkpoint {checkpoint[0].parent.name}; "
          f"{args.concurrency} worker processes per fleet; "
          f"CLI --job-size {args.job_size} --in-flight {args.in_flight}; "
          f"{args.repeats} repeats; cold-cache hit fraction median {statistics.median(hits):.0%}")
    print(f"{'run':<10} {'rows/s median':>14} {'min-max':>16} {'vs off':>8}")
    for name, s in summary.items():
        print(f"{name:<10} {s['median']:>14.1f} {s['min']:>7.1f}-{s['max']:<8.1f} {s['median'] / base:>7.2f}x")
    print("(indicative: a shared CPU; rerun serially on a quiet machine for publishable figures)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "distinct": distinct,
                                         "cold_hit_fraction": hits, "rates": rates, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
