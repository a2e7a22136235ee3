"""End-to-end at-least-once through the official client: Redis is killed -9 in the middle of a bulk
`Client.score()` and comes back EMPTY (no persistence, as a managed Redis without AOF, or a lost
node, would): every job, queued, running or done, vanishes with it. The client sees its jobs answer
404 after their 202 and submits them again under their Idempotency-Keys; every text still comes back
once, in order, with Detoxify's scores, and no exception. The API and the worker are the same
processes throughout: they reconnect by themselves."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from fleet.corpus import CommentCorpus
from testing import Proc, RedisServer, base_env, start_api, start_worker, wait_for
from testing.faults import ExecutionLog, ResultObserver, canonical_task, client_summary, measure, observing
from testing.scoring import BackgroundScore, assert_detoxify_scores
from testing.services import execution_log
from toxfleet.client import Client

pytestmark = pytest.mark.faults


ONE_AT_A_TIME: dict[str, Any] = {"concurrency": 1, "env": {"TOXFLEET_PREFETCH_MULTIPLIER": "1"}}
"""A worker that holds one message at a time, so that of the 4 jobs in flight, the ones waiting are in
Redis alone and go with it. A worker that prefetched them all (2 x 16) would score them after the wipe
and write their results to the new, empty Redis: nothing would be lost, and nothing shown."""


@pytest.fixture
def observer(bare_redis: RedisServer) -> Iterator[ResultObserver]:
    """Every final result published, subscribed before the load (it reconnects after the kill; what
    was published before it lives on in its counts, though Redis lost it)."""
    with observing(bare_redis.url) as results:
        yield results


def finished_jobs(url: str) -> int:
    client = redis.Redis.from_url(url)
    done = 0
    for key in client.scan_iter("celery-task-meta-*", count=500):
        raw = client.get(key)
        done += raw is not None and json.loads(raw).get("status") == "SUCCESS"
    return done


def test_client_recovers_every_job_when_redis_is_lost(bare_redis: RedisServer, observer: ResultObserver,
                                                      tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any,
                                                      tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      attempt: int) -> None:
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
        s = client_summary("redis-lost-client", load, observer, ExecutionLog(execution_log(tmp_path)), t0, url)
        # Jobs read before the wipe are gone from the new Redis (`vanished`), which is what "no
        # persistence" means; none reads differently (`changed`).
        assert s["lost"] == 0 and s["changed"] == 0, s
        assert s["resubmitted"] > 0, f"no job was lost with Redis: the fault landed after the load: {s}"
        assert_detoxify_scores(tiny_detoxify, texts, results)  # in order, and Detoxify's own scores
        # Nobody was restarted: the same processes, and they still serve a fresh job.
        assert all(p.alive() for p in procs) and [p.proc.pid for p in procs if p.proc is not None] == pids
        with Client(url) as c:
            assert len(c.score(texts[:5])) == 5
        assert httpx.get(url + "/readyz", timeout=5).json()["workers"] >= 1
    finally:
        for p in reversed(procs):
            p.stop()


def test_cli_recovers_every_row_when_redis_is_lost(bare_redis: RedisServer, observer: ResultObserver,
                                                   tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any,
                                                   tmp_path: Path, attempt: int) -> None:
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
        t0 = time.monotonic()
        bare_redis.start()  # empty
        _, err = cli.communicate(timeout=300)
        ended = time.monotonic()
        assert cli.returncode == 0, err
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        # Seen from outside: the rows it wrote per job of 10 (lost: a job with a row missing), and its
        # warnings naming each resubmitted job's first id. Its jobs end when the CLI exits.
        again = dict(re.findall(r"job ([0-9a-f]{32}) .*; submitted again as job ([0-9a-f]{32})", err))
        original = {new: old for old, new in again.items()}
        for new in list(original):
            while original[new] in original:
                original[new] = original[original[new]]
        written = {r["id"] for r in rows}
        slices = [range(i, min(i + 10, len(texts))) for i in range(0, len(texts), 10)]
        done = {str(k): ended for k, ids in enumerate(slices) if all(i in written for i in ids)}
        s = measure("redis-lost-cli", accepted=[str(k) for k in range(len(slices))], final=done, observed={},
                    rescored=ExecutionLog(execution_log(tmp_path)).rescored(canonical_task(original)),
                    changed=len(observer.changed), fault_at=t0, resubmitted=len(again))
        assert s["lost"] == 0 and s["changed"] == 0, s
        assert again, "no job was submitted again: the fault landed after the load"
        assert [r["id"] for r in rows] == list(range(len(texts)))
        labels = list(tiny_detoxify.class_names)
        assert_detoxify_scores(tiny_detoxify, texts, [{k: r[k] for k in labels} for r in rows])
        assert worker.alive() and api.alive()
    finally:
        if cli.poll() is None:
            cli.kill()
        api.stop()
        worker.stop()


def test_client_rides_through_an_api_kill(bare_redis: RedisServer, observer: ResultObserver,
                                          tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture, attempt: int) -> None:
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
        t0 = time.monotonic()
        api.stop()  # reaps it
        api.start()
        wait_for(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, 30, "the API to come back")
        down_s = time.monotonic() - t0
        results = load.outcome(300)
        s = client_summary("api-kill-9", load, observer, ExecutionLog(execution_log(tmp_path)), t0, url,
                           api_down_s=round(down_s, 2))
        # The API holds no state: nothing lost, nothing scored twice, nothing read differently.
        assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0 and s["vanished"] == 0, s
        assert_detoxify_scores(tiny_detoxify, texts, results)  # in order, and Detoxify's own scores
        assert worker.alive()
    finally:
        api.stop()
        worker.stop()
