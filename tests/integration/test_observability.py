"""Metrics and logs against running processes: a real Celery worker (prefork, two pool processes) and
the real API under uvicorn, both with metrics on and JSON logs; the backlog publisher on a real queue."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet import keys
from fleet.corpus import CommentCorpus
from testing import ROOT, Fleet, FleetSpec, Proc, RedisServer, api_metrics, base_env, free_port, start_api, wait_for
from toxfleet import contract

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

JOB_SIZES = [1, 3, 20, 5, 40]
"""Texts per job: 20 and 40 are split into at least 2 and 3 messages (16 texts at most each)."""


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# Databases of their own (4: the fleet, 5: the idle queue), so workers and jobs of other test modules
# never show up in the counts.
FLEET_DB, IDLE_DB = 4, 5
# Score cache off: the counts below assume every job reaches the worker, and the tests resubmit the
# same texts, which the cache would answer (its metrics are tested in test_bulk.py).
FLEET = FleetSpec("obs", db=FLEET_DB, access_log=True,
                  worker_env={"TOXFLEET_LOG_FORMAT": "json", "TOXFLEET_CACHE": "false"},
                  api_env={"TOXFLEET_LOG_FORMAT": "json", "TOXFLEET_MAX_BODY_BYTES": str(64 * 1024),
                           "TOXFLEET_CACHE": "false"})


def _run_jobs(api_url: str, sizes: list[int]) -> tuple[list[str], int]:
    """Submit jobs of these sizes, wait until all succeeded; their ids and how many messages they made."""
    corpus = CommentCorpus(7)
    jobs = [corpus.texts(n) for n in sizes]
    with httpx.Client(base_url=api_url, timeout=60) as c:
        ids = [c.post("/v1/jobs", json={"texts": texts}).json()["id"] for texts in jobs]
        for job_id in ids:
            assert c.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] == "succeeded"
    return ids, sum(len(contract.chunk(texts)) for texts in jobs)


def test_worker_metrics_add_up_across_pool_processes(fleet: Fleet) -> None:
    """After a few jobs, the worker's /metrics (summed over its pool processes) counts exactly the
    texts, messages and queue waits submitted, and batch histograms agree with the counters."""
    before = scrape(fleet.worker_metrics)
    _, messages = _run_jobs(fleet.url, JOB_SIZES)
    texts = sum(JOB_SIZES)
    assert messages >= 1 + 1 + 2 + 1 + 3
    # Counters are written right after the results, which the client may see first: wait for them.
    wait_for(lambda: delta(before, scrape(fleet.worker_metrics), "toxfleet_tasks_total", outcome="succeeded")
             == messages, 10, "task counters")
    after = scrape(fleet.worker_metrics)

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("toxfleet_texts_scored_total") == texts
    assert d("toxfleet_batch_texts_sum") == texts
    assert d("toxfleet_batch_requests_sum") == messages
    assert d("toxfleet_queue_wait_seconds_count") == messages  # every API message carries its publish time
    assert 0 <= d("toxfleet_queue_wait_seconds_sum") < 60 * messages
    batches = d("toxfleet_batch_requests_count")
    assert 1 <= batches <= messages
    assert d("toxfleet_inference_seconds_count") == batches == d("toxfleet_batch_texts_count")
    assert d("toxfleet_inference_seconds_sum") > 0
    assert d("toxfleet_tokens_total") == d("toxfleet_batch_tokens_sum") > 0
    assert d("toxfleet_padded_tokens_total") >= d("toxfleet_tokens_total")
    assert d("toxfleet_forward_passes_total") >= batches
    assert d("toxfleet_tasks_total", outcome="failed") == 0


def test_worker_counts_failures_by_reason(fleet: Fleet) -> None:
    """A request with bad input counts as failed (reason invalid); sent without the API's header, it
    adds no queue-wait sample."""
    from celery import Celery

    before = scrape(fleet.worker_metrics)
    app = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    app.conf.update(result_serializer="json", accept_content=["json"], task_default_queue=contract.QUEUE)
    with pytest.raises(Exception, match="not a string"):
        app.send_task(contract.SCORE_TASK, args=[["fine", 3]]).get(timeout=30)
    wait_for(lambda: delta(before, scrape(fleet.worker_metrics), "toxfleet_task_failures_total",
                           reason="invalid") == 1, 10, "failure counter")
    after = scrape(fleet.worker_metrics)
    assert delta(before, after, "toxfleet_tasks_total", outcome="failed") == 1
    assert delta(before, after, "toxfleet_queue_wait_seconds_count") == 0


def test_api_metrics_count_requests_by_route_template(fleet: Fleet) -> None:
    """The API counts and times each request under its route template and status, never the raw path,
    and counts the jobs, texts and messages it accepted."""
    url = fleet.url
    before = scrape(fleet.api_metrics)
    ids, messages = _run_jobs(url, [2, 17])
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.get(f"/v1/jobs/{ids[0]}").status_code == 200
        assert c.get("/v1/jobs/" + "0" * 32).status_code == 404
        assert c.get("/no/such/path").status_code == 404
        assert c.post("/v1/jobs", json={"texts": []}).status_code == 422
        assert c.post("/v1/jobs", json={"texts": ["x" * 1000] * 100}).status_code == 413  # refused before routing
    after = scrape(fleet.api_metrics)

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    job = "/v1/jobs/{job_id}"
    assert d("toxfleet_http_requests_total", route="/v1/jobs", method="POST", status="202") == 2
    assert d("toxfleet_http_requests_total", route="/v1/jobs", method="POST", status="422") == 1
    assert d("toxfleet_http_requests_total", route="/v1/jobs", method="POST", status="413") == 1
    assert d("toxfleet_http_requests_total", route=job, method="GET", status="200") == 3
    assert d("toxfleet_http_requests_total", route=job, method="GET", status="404") == 1
    assert d("toxfleet_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert d("toxfleet_http_request_duration_seconds_count", route=job, method="GET", status="200") == 3
    assert d("toxfleet_http_request_duration_seconds_sum", route=job, method="GET", status="200") > 0
    assert d("toxfleet_jobs_submitted_total") == 2
    assert d("toxfleet_texts_submitted_total") == 19
    assert d("toxfleet_messages_sent_total") == messages >= 1 + 2
    lag: tuple[str, frozenset[tuple[str, str]]] = ("toxfleet_api_loop_lag_seconds", frozenset())
    assert lag in after and 0 <= after[lag] < 1.0  # an idle API is not behind (over 0.1 s: api-busy)
    routes = {dict(labels)["route"] for name, labels in after if name == "toxfleet_http_requests_total"}
    assert not any(job_id in r for r in routes for job_id in ids), routes
    assert value(after, "toxfleet_workers") == 1 and value(after, "toxfleet_broker_up") == 1


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON log line: {line!r}")
    return parsed


def test_json_logs_carry_the_job_ids_on_both_tiers(fleet: Fleet) -> None:
    """With TOXFLEET_LOG_FORMAT=json every line both processes write is JSON; the API's access lines of
    the submits carry each job's id and counts, those of the reads its outcome, and the worker's batch
    lines name the jobs they concern."""
    (small, large), messages = _run_jobs(fleet.url, [2, 18])
    ids = {small, large}
    wait_for(lambda: ids <= {j for e in _json_lines(fleet.worker.output()) for j in e.get("job_ids", [])},
             10, "worker batch lines")
    worker_lines = _json_lines(fleet.worker.output())
    batch_lines = [e for e in worker_lines if e["logger"] == "worker.tasks" and e["message"].startswith("batch ")]
    assert all({"batch_id", "requests", "texts", "tokens", "seconds"} <= set(e) for e in batch_lines)
    assert any("ready" in e["message"] for e in worker_lines)

    api_lines = _json_lines(fleet.api.output())
    access = [e for e in api_lines if e["logger"] == "uvicorn.access" and e.get("job_id") in ids]
    submitted = {(e["job_id"], e["texts"], e["messages"])
                 for e in access if (e["method"], e["status"]) == ("POST", 202)}
    assert submitted == {(small, 2, 1), (large, 18, messages - 1)}
    finished = {e["job_id"] for e in access if e["method"] == "GET" and e.get("job_status") == "succeeded"}
    assert finished == set(ids)
    assert any(e["logger"].startswith("uvicorn") for e in api_lines)


def test_publisher_emits_the_job_latency_of_every_finished_message(fleet: Fleet) -> None:
    """The workers record one latency sample per API message they finish (publish to result stored);
    the backlog publisher's next reading carries exactly those in JobLatency (seconds, within the time the
    jobs took), and the reading after it none: the samples are taken once."""
    publish_lines(fleet.redis_url)  # take what earlier tests left
    started = time.time()
    _, messages = _run_jobs(fleet.url, JOB_SIZES)
    took = time.time() - started
    (doc,) = publish_lines(fleet.redis_url)
    (directive,) = doc["_aws"]["CloudWatchMetrics"]
    assert {"Name": "JobLatency", "Unit": "Seconds"} in directive["Metrics"]
    samples = doc["JobLatency"]
    assert len(samples) == messages
    assert all(0 <= s <= took for s in samples), (samples, took)
    assert max(samples) > 0
    (after,) = publish_lines(fleet.redis_url)
    assert "JobLatency" not in after
    assert "JobLatency" not in {m["Name"] for m in after["_aws"]["CloudWatchMetrics"][0]["Metrics"]}


# -- queue depth, unacked, backlog publisher (no worker consuming) -------------------------------


@pytest.fixture(scope="module")
def idle_queue(redis_server: RedisServer, session_tmp: Path) -> Iterator[dict[str, Any]]:
    import redis

    url = redis_server.flush(IDLE_DB)
    api, api_url = start_api(session_tmp, url, name="obs-idle-api")
    yield {"url": api_url, "metrics": api_metrics(api), "redis_url": url, "client": redis.Redis.from_url(url)}
    api.stop()


def publish_lines(redis_url: str, service: str = "toxfleet-worker") -> list[dict[str, Any]]:
    """The EMF documents of one reading of the real publisher (`python -m tools.backlog --once`)."""
    out = subprocess.run([sys.executable, "-m", "tools.backlog", "--once", "--redis-url", redis_url,
                          "--service", service], cwd=ROOT, env=base_env(redis_url, None), capture_output=True,
                         text=True, timeout=30, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def publish_once(redis_url: str, service: str = "toxfleet-worker") -> dict[str, Any]:
    (doc,) = publish_lines(redis_url, service)
    return doc


def test_queue_gauges_and_backlog_count_waiting_and_unacked_messages(idle_queue: dict[str, Any]) -> None:
    """With 4 messages queued and 1 of them delivered but unacknowledged, /metrics reports depth 3 and
    unacked 1, and the publisher's EMF line reports the backlog per live worker."""
    from api.celery_client import make_celery
    from api.settings import ApiSettings

    with httpx.Client(base_url=idle_queue["url"], timeout=10) as c:
        for n in (2, 2 * contract.CHUNK_TEXTS, 1):  # 1 + 2 + 1 messages
            assert c.post("/v1/jobs", json={"texts": ["queued text"] * n}).status_code == 202
    celery = make_celery(ApiSettings(redis_url=idle_queue["redis_url"]))
    with celery.connection_for_read() as conn:
        queue = conn.SimpleQueue(contract.QUEUE)
        message = queue.get(timeout=5)  # delivered, not acknowledged: kombu moves it to `unacked`
        assert message.headers["task"] == contract.SCORE_TASK
        samples = scrape(idle_queue["metrics"])
        assert value(samples, "toxfleet_queue_depth") == 3
        assert value(samples, "toxfleet_queue_unacked") == 1
        assert value(samples, "toxfleet_workers") == 0

        doc = publish_once(idle_queue["redis_url"], service="svc-a")
        assert (doc["QueueDepth"], doc["Unacked"], doc["Backlog"], doc["Workers"], doc["FallbackWorkers"]) == \
            (3, 1, 4, 0, 0)
        assert doc["BacklogPerTask"] == 4.0  # no live worker: the whole backlog, so scale-out still sees it
        meta = doc["_aws"]
        assert abs(meta["Timestamp"] / 1000 - time.time()) < 30
        (directive,) = meta["CloudWatchMetrics"]
        assert directive["Namespace"] == "toxfleet" and directive["Dimensions"] == [["Service"]]
        assert doc["Service"] == "svc-a"
        names = [m["Name"] for m in directive["Metrics"]]
        assert "BacklogPerTask" in names and "QueueDepth" in names
        assert all(isinstance(doc[n], int | float) for n in names)

        # Two workers beating, one long silent: backlog per task is shared by the two.
        now = time.time()
        idle_queue["client"].zadd(keys.WORKERS_KEY, {"w1@h": now, "w2@h": now, "gone@h": now - 600})
        doc = publish_once(idle_queue["redis_url"])
        assert (doc["Workers"], doc["BacklogPerTask"], doc["Service"]) == (2, 2.0, "toxfleet-worker")
        message.requeue()


def test_publisher_splits_many_latency_samples_into_emf_lines(idle_queue: dict[str, Any]) -> None:
    """More samples than one EMF metric may carry go out in further lines of JobLatency alone, every
    sample once, in the order recorded."""
    from fleet import latency
    from tools.backlog import EMF_MAX_VALUES

    publish_lines(idle_queue["redis_url"])
    samples = [i / 8 for i in range(2 * EMF_MAX_VALUES + 50)]
    with idle_queue["client"].pipeline(transaction=False) as pipe:
        latency.record(pipe, samples)
        pipe.execute()
    docs = publish_lines(idle_queue["redis_url"])
    assert [len(d["JobLatency"]) for d in docs] == [EMF_MAX_VALUES, EMF_MAX_VALUES, 50]
    assert [s for d in docs for s in d["JobLatency"]] == samples
    assert "Workers" in docs[0] and all(set(d) == {"_aws", "Service", "JobLatency"} for d in docs[1:])


def test_metrics_answer_while_redis_is_down(session_tmp: Path) -> None:
    """/metrics still answers when Redis does not: broker_up 0 and no queue numbers (NaN)."""
    api, _ = start_api(session_tmp, f"redis://127.0.0.1:{free_port()}/0", name="obs-noredis-api",
                       TOXFLEET_REDIS_TIMEOUT="0.3")
    try:
        samples = scrape(api_metrics(api))
    finally:
        api.stop()
    assert value(samples, "toxfleet_broker_up") == 0
    assert value(samples, "toxfleet_queue_depth") != value(samples, "toxfleet_queue_depth")  # NaN
    assert value(samples, "toxfleet_worker_processes") != value(samples, "toxfleet_worker_processes")  # NaN
    assert not [name for name, _ in samples if name == "toxfleet_fleet_workers"]  # no stale backends


def test_metrics_are_served_on_their_own_port_only(redis_server: RedisServer, session_tmp: Path) -> None:
    """The API's public port answers /metrics with 404 (it never serves them, so a load balancer
    forwarding that port cannot expose them); its metrics port serves them, without a key even with
    API keys on (a scraper has none) while jobs need one. TOXFLEET_API_METRICS_PORT=0: no listener."""
    url = redis_server.db_url(IDLE_DB)
    api, base = start_api(session_tmp, url, name="obs-keys-api", TOXFLEET_API_KEYS="k" * 20)
    try:
        public = httpx.get(base + "/metrics", timeout=5)
        assert public.status_code == 404 and public.headers["content-type"] == "application/problem+json"
        assert httpx.post(base + "/v1/jobs", json={"texts": ["x"]}, timeout=5).status_code == 401
        samples = scrape(api_metrics(api))
        assert value(samples, "toxfleet_http_requests_total", route="/v1/jobs", method="POST", status="401") == 1
        assert value(samples, "toxfleet_http_requests_total", route="unmatched", method="GET", status="404") == 1
        assert value(samples, "toxfleet_broker_up") == 1
    finally:
        api.stop()
    assert f"serving Prometheus metrics on {api_metrics(api)}" in api.output()
    api, base = start_api(session_tmp, url, name="obs-off-api", TOXFLEET_API_METRICS_PORT="0")
    try:
        assert httpx.get(base + "/metrics", timeout=5).status_code == 404
    finally:
        api.stop()
    assert "Prometheus" not in api.output()


def test_api_refuses_to_start_when_its_metrics_port_is_taken(session_tmp: Path) -> None:
    """A second API process on the same metrics port (`uvicorn --workers 2`, a stray process) does not
    start without its metrics: it exits at once, naming the setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = Proc("obs-taken-api", [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1",
                                      "--port", str(free_port())],
                    base_env(f"redis://127.0.0.1:{free_port()}/0", None, TOXFLEET_API_METRICS_PORT=str(port)),
                    session_tmp / "obs-taken-api.log").start()
        try:
            assert proc.proc is not None and proc.proc.wait(30) != 0
        finally:
            proc.stop()
    assert "TOXFLEET_API_METRICS_PORT: cannot serve metrics on 127.0.0.1:" in proc.output()
