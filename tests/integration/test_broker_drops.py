"""A worker keeps scoring through broker connection drops (a failover, a proxy reset, a Redis kill):
Redis keeps its data here, every client connection is cut (`CLIENT KILL TYPE normal`), and after each
cut the worker must store a new result within seconds.

For Celery a cut is a consumer restart, and the pool forgets every job it was handed but had not yet
started (`Consumer.on_close` -> `AsynPool.flush` discards them; their callbacks never fire). A batch
dispatched in that window once held its pool slot forever: with one process the worker kept
heartbeating, looked ready, and scored nothing again (the hang of `toxfleet score` over an emptied
Redis, 1 CI run in 4). The window is usually a millisecond; it is seconds long while a killed pool
process is being replaced (the new one loads the model), which is where this test cuts."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import redis

from fleet.corpus import CommentCorpus
from testing import RedisServer, child_pids, start_api, start_worker, wait_for
from testing.scoring import BackgroundScore, assert_detoxify_scores

RESUME_WITHIN = 30.0
"""Seconds after a cut within which the worker must have stored a new result (a replaced pool
process needs a few of them to load the model)."""


def succeeded(client: redis.Redis) -> int:
    done = 0
    for key in client.scan_iter("celery-task-meta-*", count=1000):
        raw = client.get(key)
        done += raw is not None and json.loads(raw).get("status") == "SUCCESS"
    return done


def test_worker_scores_on_after_a_cut_while_a_batch_waits_for_a_process(
        bare_redis: RedisServer, tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any, tmp_path: Path) -> None:
    # Prefetch above the client's jobs in flight: the consumer always has a read pending, so it
    # sees the cut at once (with its prefetch full it would only reconnect quietly on its next read).
    worker = start_worker(tmp_path, bare_redis.url, tiny_checkpoint, name="cut", concurrency=1,
                          env={"TOXFLEET_PREFETCH_MULTIPLIER": "64"})
    api, url = start_api(tmp_path, bare_redis.url, name="cut-api")
    assert worker.proc is not None
    texts = CommentCorpus(31).texts(1500)
    # No stall resubmits: every job must come back through the broker's own redelivery.
    load = BackgroundScore(url, texts, stall_after=None, job_size=3, in_flight=8, priority="interactive")
    admin = redis.Redis.from_url(bare_redis.url)
    try:
        load.start()
        wait_for(lambda: succeeded(admin) >= 20, 60, "the first jobs to finish", interval=0.05)
        # Kill the only pool process: its batch is retried, and the next one is handed to a pool that
        # has no process ready until the replacement has loaded the model. Cut the broker meanwhile.
        (pool_process,) = child_pids(worker.proc.pid)
        os.kill(pool_process, signal.SIGKILL)
        time.sleep(0.5)
        before = succeeded(admin)
        admin.client_kill_filter(_type="normal", skipme=True)
        assert load.is_alive(), "the load finished before the cut: nothing was shown"
        wait_for(lambda: succeeded(admin) > before, RESUME_WITHIN,
                 "a new result after the cut (the worker stopped scoring)", interval=0.1)
        assert_detoxify_scores(tiny_detoxify, texts, load.outcome(180))
        assert worker.alive() and api.alive()
        # The cut found a batch waiting for the replacement process (the case shown), whether the kill
        # itself landed on a batch or between two.
        assert re.search(r"consumer restarted: [1-9]\d* batches the pool discarded", worker.output())
    finally:
        api.stop()
        worker.stop()
