"""End to end: a real Celery worker process and real Flower on the tiny synthetic checkpoint, the real
API served by uvicorn, several concurrent HTTP clients, scores checked against Detoxify itself."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from typing import Any

import httpx
import pytest
import redis

from fleet import keys
from fleet.corpus import CommentCorpus
from testing import Fleet, FleetSpec, child_pids, wait_for
from toxfleet import contract

FLOWER_AUTH = ("tester", "s3cret-flower")


# The blocker job below is 200 messages on its own; backpressure has its own tests in test_api.py.
FLEET = FleetSpec("e2e", api_env={"TOXFLEET_BACKLOG_PER_PROCESS": "10000"}, flower_auth=FLOWER_AUTH)


def _assert_matches(reference: Any, texts: list[str], results: list[dict[str, float]]) -> None:
    expected = reference.predict(texts)
    assert len(results) == len(texts)
    for i, row in enumerate(results):
        assert set(row) == set(expected)
        for label, value in row.items():
            want = expected[label][i] if len(texts) > 1 else expected[label]
            assert value == pytest.approx(want, abs=1e-4), (i, label)


def test_concurrent_clients_get_correct_scores(fleet: Fleet, tiny_detoxify: Any) -> None:
    """Eight clients submit jobs at once and poll to succeeded; every score equals Detoxify.predict."""
    corpus = CommentCorpus(21)
    jobs = [corpus.texts(1 + i % 4) for i in range(24)]

    def run(texts: list[str]) -> dict[str, Any]:
        with httpx.Client(base_url=fleet.url, timeout=60) as c:
            r = c.post("/v1/jobs", json={"texts": texts})
            assert r.status_code == 202
            location = r.headers["location"]
            for _ in range(10):
                body: dict[str, Any] = c.get(location, params={"wait": 10}).json()
                if body["status"] in ("succeeded", "failed"):
                    return body
            raise AssertionError(f"job never finished: {body}")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(run, jobs))
    for texts, body in zip(jobs, bodies, strict=True):
        assert body["status"] == "succeeded", body
        assert body["model"] == "checkpoint:tiny/model.ckpt" and body["error"] is None
        assert body["progress"] == {"done": len(texts), "total": len(texts)}
        _assert_matches(tiny_detoxify, texts, body["results"])


BURST = 30
"""Jobs of the batching test: all of them fit in what the worker prefetches (2 processes x 16)."""


def test_texts_from_several_jobs_share_one_batch(fleet: Fleet) -> None:
    """While the pool is busy, small jobs from many clients queue up and are scored in one batch."""
    from celery import Celery

    # Sending without a result backend: a sender with one subscribes to every task's result channel,
    # which outlives the test (its AsyncResults then try to unsubscribe from a stopped Redis).
    sender = Celery(broker=fleet.redis_url)
    sender.conf.update(task_serializer="json", accept_content=["json"])
    reader = Celery(backend=fleet.redis_url)
    reader.conf.update(result_serializer="json", accept_content=["json"])
    assert fleet.worker.proc is not None
    pool = child_pids(fleet.worker.proc.pid)
    assert len(pool) == 2, pool
    # The pool processes are held busy (stopped) while the jobs arrive, as a long batch would hold them,
    # but for exactly as long as the main process needs to buffer every job, however slow the machine.
    for pid in pool:
        os.kill(pid, signal.SIGSTOP)
    try:
        ids = [sender.send_task(contract.SCORE_TASK, args=[[f"burst text {i}"]], queue=contract.QUEUE).id
               for i in range(BURST)]
        client = redis.Redis.from_url(fleet.redis_url)
        wait_for(lambda: client.llen(contract.QUEUE) == 0 and client.hlen(keys.UNACKED_KEY) >= BURST, 60,
                 "the worker to take every job")
    finally:
        for pid in pool:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: all(reader.backend.get_task_meta(t)["status"] == "SUCCESS" for t in ids), 60, "the jobs")
    batches: dict[str, set[str]] = {}
    for task_id in ids:
        meta = reader.backend.get_task_meta(task_id)
        assert len(meta["result"]) == 1
        batches.setdefault(meta["batch"]["id"], set()).add(task_id)
    sizes = sorted((len(j) for j in batches.values()), reverse=True)
    # Each stopped process was handed the first job that came; the rest behind them are shared out
    # when the processes resume.
    assert sizes[0] >= 8 and sum(sizes) == BURST, f"jobs per batch: {sizes}"
    assert "requests=" in fleet.worker.output()


def test_long_poll_answers_as_soon_as_the_result_lands(fleet: Fleet) -> None:
    """?wait=30 on a small job returns well before 30 s: the API is woken by the result, not a timer."""
    with httpx.Client(base_url=fleet.url, timeout=40) as c:
        job_id = c.post("/v1/jobs", json={"texts": ["quick one"]}).json()["id"]
        t0 = time.monotonic()
        body = c.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        assert body["status"] == "succeeded"
        assert time.monotonic() - t0 < 5


def test_compat_endpoints_return_the_old_shapes(fleet: Fleet, tiny_detoxify: Any) -> None:
    """GET /toxicity?q= returns {label: float}; POST /toxicity/batch returns a list of them."""
    with httpx.Client(base_url=fleet.url, timeout=40) as c:
        one = c.get("/toxicity", params={"q": "you are a lovely person"})
        assert one.status_code == 200
        _assert_matches(tiny_detoxify, ["you are a lovely person"], [one.json()])
        texts = ["first text", "second, longer text here", "third"]
        many = c.post("/toxicity/batch", json=texts)
        assert many.status_code == 200
        _assert_matches(tiny_detoxify, texts, many.json())
        assert c.post("/toxicity/batch", json=[]).status_code == 422


def test_direct_celery_calls(fleet: Fleet, tiny_detoxify: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python callers: send_task by name and the task object's .delay both return one dict per text."""
    monkeypatch.setenv("REDIS_URL", fleet.redis.url)
    from worker import app
    from worker.tasks import score

    app.conf.broker_url = app.conf.result_backend = fleet.redis.url
    texts = ["direct call one", "direct call two"]
    by_name = app.send_task("toxfleet.score", args=[texts]).get(timeout=30)
    by_task = score.delay(texts).get(timeout=30)
    _assert_matches(tiny_detoxify, texts, by_name)
    assert by_task == by_name
    with pytest.raises(ValueError, match="not a string"):
        app.send_task("toxfleet.score", args=[["ok", 3]]).get(timeout=30)


def test_readyz_reports_the_worker(fleet: Fleet) -> None:
    """/readyz counts the answering worker and names its model."""
    body = httpx.get(fleet.url + "/readyz", timeout=5).json()
    assert body["status"] == "ready" and body["workers"] == 1
    assert body["models"] == ["checkpoint:tiny/model.ckpt"]


def test_flower_shows_the_worker_and_tasks_behind_auth(fleet: Fleet) -> None:
    """Flower lists the worker and the scoring tasks, and refuses requests without credentials."""
    flower = fleet.flower
    assert httpx.get(flower + "/api/workers", timeout=5).status_code == 401
    with httpx.Client(base_url=flower, auth=FLOWER_AUTH, timeout=10) as c:
        wait_for(lambda: fleet.worker.extra["hostname"] in c.get("/api/workers", params={"refresh": 1}).json(),
                 20, "flower to see the worker")
        job_id = httpx.post(fleet.url + "/v1/jobs", json={"texts": ["seen by flower"]}, timeout=10).json()["id"]

        def task_listed() -> bool:
            tasks = c.get("/api/tasks").json()
            return any(t.get("name") == contract.SCORE_TASK and t.get("state") == "SUCCESS" for t in tasks.values())

        wait_for(task_listed, 20, "flower to list a succeeded toxfleet.score task")

        def this_task() -> dict[str, Any] | None:
            # Found by its task id: events carry a summary of the arguments, never the texts.
            task: dict[str, Any] | None = c.get("/api/tasks").json().get(contract.chunk_task_id(job_id, 0))
            return task if task and task.get("state") == "SUCCESS" else None

        # The worker sends one event per request (no task-received): that one carries the name, the
        # arguments and the time the worker received the request.
        wait_for(lambda: this_task() is not None, 20, "flower to list the job's task as succeeded")
        task = this_task()
        assert task is not None and task["name"] == contract.SCORE_TASK, task
        assert "seen by flower" not in str(task) and task["args"] == contract.args_summary([["seen by flower"]]), task
        assert task["received"] and task["received"] <= task["succeeded"], task
