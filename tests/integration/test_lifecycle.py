"""A job's lifecycle on a real fleet: timestamps as it runs, and DELETE (204, then 404; a worker skips
the deleted job's messages not yet scored, and counts them)."""

from __future__ import annotations

from datetime import datetime

import httpx
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.main import create_app
from api.settings import ApiSettings
from fleet import keys
from fleet.corpus import CommentCorpus
from testing import Fleet, FleetSpec, RedisServer, wait_for
from toxfleet import contract

FLEET = FleetSpec("life", db=7, worker_env={"TOXFLEET_CACHE": "false"},
                  api_env={"TOXFLEET_CACHE": "false", "TOXFLEET_BACKLOG_PER_PROCESS": "1000"})


def cancelled(metrics_url: str) -> float:
    families = text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text)
    return sum(s.value for f in families for s in f.samples
               if s.name == "toxfleet_tasks_total" and s.labels.get("outcome") == "cancelled")


def when(value: str) -> datetime:
    assert value.endswith("Z")
    return datetime.fromisoformat(value)


def test_timestamps_follow_the_job(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        job_id = c.post("/v1/jobs", json={"texts": CommentCorpus(3).texts(4)}).json()["id"]
        job = c.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
    assert job["status"] == "succeeded"
    created, started, finished, expires = (when(job[k]) for k in ("created_at", "started_at", "finished_at",
                                                                   "expires_at"))
    assert created <= started <= finished < expires
    assert (expires - created).total_seconds() == ApiSettings().result_expires


def test_delete_forgets_the_job_and_workers_skip_its_messages(fleet: Fleet) -> None:
    """The deleted job's messages are skipped by the batches that receive them: acked and counted as
    cancelled, with no batch failing over them (a failed batch would retry every request in it,
    other jobs' included, and end them as worker_lost)."""
    before = cancelled(fleet.worker_metrics)
    log_start = len(fleet.worker.output())
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        texts = CommentCorpus(11).texts(400)  # 50 messages: far more than one worker scores in a moment
        job_id = c.post("/v1/jobs", json={"texts": texts}).json()["id"]
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 204
        gone = c.get(f"/v1/jobs/{job_id}")
        assert gone.status_code == 404 and gone.json()["type"] == "/problems/not-found"
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 404
        # The worker drains the queue, skipping what it had not scored yet.
        queue = redis.Redis.from_url(fleet.redis_url)
        wait_for(lambda: queue.llen(contract.QUEUE) == 0 and cancelled(fleet.worker_metrics) > before, 60,
                 "the deleted job's messages to be skipped")
        # The fleet still scores the next job.
        after = c.post("/v1/jobs", json={"texts": ["still working"]}).json()["id"]
        assert c.get(f"/v1/jobs/{after}", params={"wait": 30}).json()["status"] == "succeeded"
    assert "failed in the pool" not in fleet.worker.output()[log_start:]
    assert redis.Redis.from_url(fleet.redis_url).get(keys.job_key(job_id)) is None


def test_delete_without_a_worker_clears_pending_and_marks_the_job(clean_redis: RedisServer) -> None:
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url))) as c:
        accepted = c.post("/v1/jobs", json={"texts": ["a", "b"]}).json()
        assert accepted["status"] == "queued"
        job = c.get(accepted["url"]).json()
        assert job["created_at"] and job["expires_at"] and job["started_at"] is None and job["finished_at"] is None
        r = clean_redis.client()
        assert r.zcard(keys.PENDING_KEY) == 1
        assert c.delete(accepted["url"]).status_code == 204
        assert r.zcard(keys.PENDING_KEY) == 0 and r.get(keys.cancelled_key(accepted["id"])) == b"1"
        assert c.get(accepted["url"]).status_code == 404
