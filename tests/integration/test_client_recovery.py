"""End-to-end at-least-once through the official client: Redis is killed -9 in the middle of a bulk
`Client.score()` and comes back EMPTY (no persistence, as a managed Redis without AOF, or a lost
node, would): every job, queued, running or done, vanishes with it. The client sees its jobs answer
404 after their 202 and submits them again under their Idempotency-Keys; every text still comes back
once, in order, with Detoxify's scores, and no exception. The API and the worker are the same
processes throughout: they reconnect by themselves."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from fleet.corpus import CommentCorpus
from testing import Proc, RedisServer, base_env, start_api, start_worker, wait_for
from testing.faults import record
from testing.scoring import BackgroundScore, assert_detoxify_scores
from toxfleet.client import Client

pytestmark = pytest.mark.faults


ONE_AT_A_TIME: dict[str, Any] = {"concurrency": 1, "env": {"TOXFLEET_PREFETCH_MULTIPLIER": "1"}}
"""A worker that holds one message at a time, so that of the 4 jobs in flight, the ones waiting are in
Redis alone and go with it. A worker that prefetched them all (2 x 16) would score them after the wipe
and write their results to the new, empty Redis: nothing would be lost, and nothing shown."""


def finished_jobs(url: str) -> int:
    client = redis.Redis.from_url(url)
    done = 0
    for key in client.scan_iter("celery-task-meta-*", count=500):
        raw = client.get(key)
        done += raw is not None and json.loads(raw).get("status") == "SUCCESS"
    return done


def test_client_recovers_every_job_when_redis_is_lost(bare_redis: RedisServer, tiny_checkpoint: tuple[Path, Path],
                                                      tiny_detoxify: Any, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="toxfleet.client")
    worker = start_worker(tmp_path, bare_redis.url, tiny_checkpoint, name="keeps-running", **ONE_AT_A_TIME)
    api, url = start_api(tmp_path, bare_redis.url)
    procs: list[Proc] = [worker, api]
    pids = [p.proc.pid for p in procs if p.proc is not None]
    texts = CommentCorpus(21).texts(400)
    load = BackgroundScore(url, texts, job_size=10, in_flight=4)
    try:
        load.start()
        wait_for(lambda: finished_jobs(bare_redis.url) >= 3, 60, "the first jobs to finish", interval=0.02)
        assert load.is_alive(), "the load finished before the fault: nothing was shown"
        bare_redis.kill()
        t0 = time.monotonic()
        bare_redis.start()  # empty: no AOF, no RDB
        results = load.outcome(300)
        recovery = time.monotonic() - t0
        resubmitted = sum("submitted again" in r.getMessage() for r in caplog.records)
        record("redis-lost-client", {"submitted": len(texts), "succeeded": len(results),
                                     "lost": len(texts) - len(results), "duplicated": 0,
                                     "resubmitted_jobs": resubmitted}, recovery)
        assert resubmitted > 0, "no job was lost with Redis: the fault landed after the load"
        assert_detoxify_scores(tiny_detoxify, texts, results)  # in order, and Detoxify's own scores
        # Nobody was restarted: the same processes, and they still serve a fresh job.
        assert all(p.alive() for p in procs) and [p.proc.pid for p in procs if p.proc is not None] == pids
        with Client(url) as c:
            assert len(c.score(texts[:5])) == 5
        assert httpx.get(url + "/readyz", timeout=5).json()["workers"] >= 1
    finally:
        for p in reversed(procs):
            p.stop()


def test_cli_recovers_every_row_when_redis_is_lost(bare_redis: RedisServer, tiny_checkpoint: tuple[Path, Path],
                                                   tiny_detoxify: Any, tmp_path: Path) -> None:
    """`toxfleet score` over a file, Redis killed -9 mid-run and restarted empty: it exits 0 and every
    row is in the output once, in order, with Detoxify's scores (it waits through the same client)."""
    worker = start_worker(tmp_path, bare_redis.url, tiny_checkpoint, name="cli-keeps-running", **ONE_AT_A_TIME)
    api, url = start_api(tmp_path, bare_redis.url, name="cli-api")
    texts = CommentCorpus(22).texts(400)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    toxfleet = str(Path(sys.executable).parent / "toxfleet")
    cli = subprocess.Popen([toxfleet, "score", str(src), "-o", str(out), "--url", url, "--job-size", "10",
                            "--in-flight", "4", "--stall-after", "60", "--no-progress"],
                           env=base_env(bare_redis.url, None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_for(lambda: finished_jobs(bare_redis.url) >= 3, 60, "the first jobs to finish", interval=0.02)
        assert cli.poll() is None, "the CLI finished before the fault: nothing was shown"
        bare_redis.kill()
        bare_redis.start()  # empty
        _, err = cli.communicate(timeout=300)
        assert cli.returncode == 0, err
        assert "submitted again" in err  # the client's warning: jobs really were lost and resubmitted
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["id"] for r in rows] == list(range(len(texts)))
        labels = list(tiny_detoxify.class_names)
        assert_detoxify_scores(tiny_detoxify, texts, [{k: r[k] for k in labels} for r in rows])
        assert worker.alive() and api.alive()
    finally:
        if cli.poll() is None:
            cli.kill()
        api.stop()
        worker.stop()


def test_client_rides_through_an_api_kill(bare_redis: RedisServer, tiny_checkpoint: tuple[Path, Path],
                                          tiny_detoxify: Any, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """The API killed -9 in the middle of a bulk `Client.score()` and started again on its port (as ECS
    replaces a task behind the same target group): the API holds no state, the client retries through
    the connection errors, and every text comes back once, in order, with Detoxify's scores."""
    caplog.set_level(logging.WARNING, logger="toxfleet.client")
    worker = start_worker(tmp_path, bare_redis.url, tiny_checkpoint, name="serves-on", **ONE_AT_A_TIME)
    api, url = start_api(tmp_path, bare_redis.url, name="killed-api")
    texts = CommentCorpus(23).texts(400)
    load = BackgroundScore(url, texts, job_size=10, in_flight=4)
    try:
        load.start()
        wait_for(lambda: finished_jobs(bare_redis.url) >= 3, 60, "the first jobs to finish", interval=0.02)
        assert load.is_alive(), "the load finished before the fault: nothing was shown"
        api.signal(signal.SIGKILL)
        api.stop()  # reaps it
        t0 = time.monotonic()
        api.start()
        wait_for(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, 30, "the API to come back")
        down_s = time.monotonic() - t0
        results = load.outcome(300)
        resubmitted = sum("submitted again" in r.getMessage() for r in caplog.records)
        record("api-kill-9", {"submitted": len(texts), "succeeded": len(results), "lost": len(texts) - len(results),
                              "duplicated": 0, "resubmitted_jobs": resubmitted, "api_down_s": round(down_s, 1)},
               time.monotonic() - t0)
        assert_detoxify_scores(tiny_detoxify, texts, results)  # in order, and Detoxify's own scores
        assert worker.alive()
    finally:
        api.stop()
        worker.stop()
