"""The HTTP contract against the real app and a real Redis (no worker: jobs stay queued here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from redis.exceptions import RedisError

from api.celery_client import Messages, Publisher, make_celery, send_messages
from api.main import create_app
from api.settings import ApiSettings
from fleet import keys, meta
from fleet.cache import ScoreCache, namespace
from fleet.transport import Transport
from testing import RedisServer, free_port
from toxfleet import contract


@pytest.fixture
def client(clean_redis: RedisServer) -> Iterator[TestClient]:
    settings = ApiSettings(redis_url=clean_redis.url, max_texts=5, max_text_chars=50, max_wait=2)
    with TestClient(create_app(settings)) as c:
        yield c


def test_submit_answers_202_with_location_and_retry_after(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """POST /v1/jobs enqueues one task message per chunk and answers 202, Location, Retry-After."""
    r = client.post("/v1/jobs", json={"texts": ["hello", "world"]})
    assert r.status_code == 202
    body = r.json()
    assert body["status"] == "queued" and len(body["id"]) == 32
    assert r.headers["location"] == f"/v1/jobs/{body['id']}" == body["url"]
    assert int(r.headers["retry-after"]) >= 1
    assert redis_server.client().llen(contract.QUEUE) == 1


def test_submitting_subscribes_to_nothing(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Sending a task costs no pub/sub round trip. Celery's Redis backend subscribes the sender to each
    task's result channel (for `AsyncResult.get`, which the API never calls) and unsubscribes when the
    result object is collected: two extra commands per message, and redis-py's PubSub keeps every
    channel name it never read a confirmation for, so the API's memory would grow with every job."""
    r = redis_server.client()
    r.config_resetstat()
    for i in range(5):
        assert client.post("/v1/jobs", json={"texts": [f"text {i}"]}).status_code == 202
    stats = r.info("commandstats")
    assert stats.get("cmdstat_lpush", {}).get("calls", 0) >= 5  # the messages went out
    assert "cmdstat_subscribe" not in stats and "cmdstat_unsubscribe" not in stats, stats


def test_a_burst_of_submits_shares_one_read_of_the_fleet(bare_redis: RedisServer) -> None:
    """Each submit asks which workers are alive and how much work waits (backpressure). When the cached
    view expires under load, the submits of that moment share one read rather than each making it."""
    import asyncio

    import redis.asyncio as aioredis

    from api.services.fleet import FleetService

    async def burst() -> None:
        client = aioredis.Redis.from_url(bare_redis.url)
        try:
            fleet = FleetService(client)
            views = await asyncio.gather(*[fleet.recent_workers() for _ in range(32)])
            backlogs = await asyncio.gather(*[fleet.recent_backlog() for _ in range(32)])
        finally:
            await client.aclose()
        assert views == [[]] * 32 and len({b.total for b in backlogs}) == 1

    r = bare_redis.client()
    r.config_resetstat()
    asyncio.run(burst())
    calls = {name: stat["calls"] for name, stat in r.info("commandstats").items()}
    assert calls["cmdstat_zrangebyscore"] == 1, calls  # the workers' view: one read for 32 callers
    assert max(calls.values()) <= 2, calls  # and no command of the backlog read was made per caller


def test_new_job_reads_as_queued(client: TestClient) -> None:
    """GET on a job no worker has touched says queued, with null results and progress 0/n."""
    job_id = client.post("/v1/jobs", json={"texts": ["a", "b", "c"]}).json()["id"]
    r = client.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200
    body = r.json()
    created, expires = body.pop("created_at"), body.pop("expires_at")
    assert created.endswith("Z") and expires > created
    assert body == {"id": job_id, "status": "queued", "results": None, "model": None, "error": None,
                    "progress": {"done": 0, "total": 3}, "flags": None, "cache_hits": 0,
                    "started_at": None, "finished_at": None}
    assert "retry-after" in r.headers


def test_long_poll_waits_then_returns_the_current_state(client: TestClient) -> None:
    """?wait=S on an unfinished job returns after about S seconds, still queued."""
    job_id = client.post("/v1/jobs", json={"texts": ["a"]}).json()["id"]
    t0 = time.monotonic()
    r = client.get(f"/v1/jobs/{job_id}", params={"wait": 0.5})
    assert 0.45 <= time.monotonic() - t0 < 2.0
    assert r.json()["status"] == "queued"


def test_a_long_poll_on_a_job_redis_lost_answers_404(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Redis lost the job (restarted empty, or failed over to a replica that never had it) while this
    API still holds the manifest it wrote a moment ago: the long-poll answers 404 at its next recheck,
    so the client submits the job again, instead of waiting out `wait` for results that never come."""
    job_id = client.post("/v1/jobs", json={"texts": ["a"]}).json()["id"]
    redis_server.client().flushall()
    r = client.get(f"/v1/jobs/{job_id}", params={"wait": 2})
    assert r.status_code == 404 and "no job" in r.json()["detail"], r.text


def test_a_job_deleted_while_its_long_poll_waits_answers_404_at_the_recheck(
        client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The job goes after the long-poll's first read of its results: the poll's recheck (every
    `RECHECK_SECONDS`, 1 s) finds it gone and answers 404 rather than waiting out `wait`."""
    import concurrent.futures

    r = redis_server.client()
    job_id = client.post("/v1/jobs", json={"texts": ["a"]}).json()["id"]
    r.config_resetstat()

    def mgets() -> int:
        return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        poll = pool.submit(client.get, f"/v1/jobs/{job_id}", params={"wait": 2})
        while mgets() < 1 and not poll.done():  # until the poll has read the results once
            time.sleep(0.01)
        r.delete(keys.job_key(job_id))
        got = poll.result()
    took = time.monotonic() - started
    assert got.status_code == 404 and "no job" in got.json()["detail"], got.text
    assert mgets() >= 2 and took < 1.9, (mgets(), took)  # answered by a recheck, not at the end of `wait`


def test_unknown_job_is_404(client: TestClient) -> None:
    """A well-formed id that names no job is 404 with a message."""
    r = client.get("/v1/jobs/" + "0" * 32)
    assert r.status_code == 404 and "no job" in r.json()["detail"]


@pytest.mark.parametrize("bad_id", ["abc", "0" * 31, "Z" * 32, "0" * 33])
def test_malformed_job_id_is_422(client: TestClient, bad_id: str) -> None:
    """An id of the wrong shape is rejected before Redis is asked."""
    assert client.get(f"/v1/jobs/{bad_id}").status_code == 422


@pytest.mark.parametrize(("body", "needle"), [
    ({"texts": []}, "at least 1"),
    ({"texts": [1, 2]}, "valid string"),
    ({"texts": "not a list"}, "valid list"),
    ({}, "Field required"),
    ({"texts": ["x"] * 6}, "at most 5 texts"),
    ({"texts": ["ok", "y" * 51]}, "at most 50 characters"),
])
def test_bad_input_is_422_with_a_message(client: TestClient, body: object, needle: str) -> None:
    """Each kind of bad input gets a 422 whose message says what is wrong."""
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert needle in str(r.json()["detail"])


def test_invalid_json_is_422(client: TestClient) -> None:
    """A body that is not JSON is a clear 4xx, never a 500."""
    r = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in str(r.json()["detail"])


def test_wait_is_bounded(client: TestClient) -> None:
    """?wait beyond the configured maximum is refused, not silently held open."""
    job_id = client.post("/v1/jobs", json={"texts": ["a"]}).json()["id"]
    r = client.get(f"/v1/jobs/{job_id}", params={"wait": 3})
    assert r.status_code == 422 and "at most 2" in str(r.json()["detail"])
    assert client.get(f"/v1/jobs/{job_id}", params={"wait": -1}).status_code == 422


def test_large_job_is_split_into_chunks(clean_redis: RedisServer) -> None:
    """A job larger than one chunk becomes several task messages, so several workers can share it."""
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url))) as c:
        texts = [f"text number {i}" for i in range(100)]
        r = c.post("/v1/jobs", json={"texts": texts})
        assert r.status_code == 202
        assert clean_redis.client().llen(contract.QUEUE) == len(contract.chunk(texts)) > 1
        assert c.get(r.headers["location"]).json()["progress"]["total"] == 100


def test_health_endpoints(client: TestClient) -> None:
    """Liveness, readiness (broker up, no workers yet) and the drop-in health endpoints answer."""
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/healthcheck").json() == {"status": "OK"}
    assert client.get("/healthcheck/loadbalancer").json() == {"status": "OK"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["broker"] == "ok" and ready.json()["workers"] == 0


def test_queue_full_is_429_with_retry_after(clean_redis: RedisServer) -> None:
    """When more messages wait than max_queue_depth, new jobs are refused at once with 429."""
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, max_queue_depth=2))) as c:
        assert c.post("/v1/jobs", json={"texts": ["a"]}).status_code == 202
        assert c.post("/v1/jobs", json={"texts": ["b"]}).status_code == 202
        r = c.post("/v1/jobs", json={"texts": ["c"]})
        assert r.status_code == 429 and "retry-after" in r.headers and "queue is full" in r.json()["detail"]


@contextlib.contextmanager
def _saturated_app_loop(c: TestClient, step: float = 0.3) -> Iterator[None]:
    """Keep the app's event loop (the TestClient's portal) busy in blocking steps of `step` with a yield
    between them, as a saturated API's is: every wake-up of its lag monitor comes late. Enters once two
    wake-ups have; the saturation lasts until the block ends, however long its requests take (each of
    their awaits waits a step, so on a loaded CI machine three requests outlasted a fixed 4 s)."""
    stop = threading.Event()

    async def saturate() -> None:
        while not stop.is_set():
            time.sleep(step)
            await asyncio.sleep(0)

    assert c.portal is not None
    c.portal.start_task_soon(saturate)
    time.sleep(3 * step)
    try:
        yield
    finally:
        stop.set()


def test_new_work_is_refused_fast_while_the_api_loop_lags(clean_redis: RedisServer) -> None:
    """While this process's event loop stays more than max_loop_lag behind, submits and the drop-in
    endpoints answer 429 /problems/api-busy with Retry-After, before any Redis work; polls of accepted
    jobs and health checks still answer. Once the loop catches up, submits are accepted again."""
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, max_loop_lag=0.2, compat_timeout=1))) as c:
        job = c.post("/v1/jobs", json={"texts": ["a"]})
        assert job.status_code == 202
        queued = clean_redis.client().llen(contract.QUEUES[0])
        with _saturated_app_loop(c):
            refused = [c.post("/v1/jobs", json={"texts": ["b"]}), c.get("/toxicity", params={"q": "c"}),
                       c.post("/toxicity/batch", json=["d"])]
            polled, health = c.get(job.headers["location"]), c.get("/healthz")
        for r in refused:
            assert r.status_code == 429, r.text
            assert r.headers["content-type"] == "application/problem+json" and r.headers["retry-after"] == "1"
            body = r.json()
            assert body["type"] == "/problems/api-busy" and "behind" in body["detail"] and "0.2 s" in body["detail"]
        assert polled.status_code == 200 and health.status_code == 200
        assert clean_redis.client().llen(contract.QUEUES[0]) == queued  # nothing refused was enqueued
        time.sleep(4.5)  # the saturation has ended; the monitor's wake-ups come on time again
        assert c.post("/v1/jobs", json={"texts": ["e"]}).status_code == 202


def test_one_stall_refuses_nothing_and_a_max_loop_lag_of_zero_refuses_nothing(clean_redis: RedisServer) -> None:
    """A single long stall (a first request's lazy set-up, a collection) is not saturation; and 0 turns
    the check off even on a saturated loop."""
    for max_lag, saturated in [(0.1, False), (0.0, True)]:
        with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, max_loop_lag=max_lag))) as c:
            assert c.portal is not None
            if not saturated:
                c.portal.start_task_soon(_stall, 0.5)
            with _saturated_app_loop(c) if saturated else contextlib.nullcontext():
                assert c.post("/v1/jobs", json={"texts": ["a"]}).status_code == 202
                assert c.post("/v1/jobs", json={"texts": ["b"]}).status_code == 202


async def _stall(seconds: float) -> None:
    time.sleep(seconds)


def test_redis_unreachable_is_a_fast_503() -> None:
    """With no Redis listening, submit, read and readiness answer 503 + Retry-After within a second."""
    settings = ApiSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as c:
        for method, path, kw in [("post", "/v1/jobs", {"json": {"texts": ["a"]}}), ("get", "/v1/jobs/" + "0" * 32, {}),
                                 ("get", "/readyz", {})]:
            t0 = time.monotonic()
            r = getattr(c, method)(path, **kw)
            assert r.status_code == 503, (path, r.text)
            assert "retry-after" in r.headers
            assert time.monotonic() - t0 < 1.0
        assert c.get("/healthz").status_code == 200


def test_openapi_docs_are_served(client: TestClient) -> None:
    """OpenAPI schema and the /docs page exist and list the job endpoints."""
    spec = client.get("/openapi.json").json()
    assert "/v1/jobs" in spec["paths"] and "/v1/jobs/{job_id}" in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_many_long_polls_share_a_few_redis_connections(clean_redis: RedisServer) -> None:
    """150 concurrent long-polls through an API allowed 8 Redis connections all answer (no 503):
    waiting requests share one pub/sub connection instead of holding one each. A request may wait up
    to 5 s for a free connection (the default 1 s made a loaded machine answer a few 503s from
    queueing alone); an API whose waits each held a connection would still need 150 / 8 x 1.5 s."""
    import concurrent.futures

    settings = ApiSettings(redis_url=clean_redis.url, redis_max_connections=8, redis_timeout=5, max_wait=5,
                           backlog_per_process=1000)
    with TestClient(create_app(settings)) as c:
        ids = [c.post("/v1/jobs", json={"texts": [f"t{i}"]}).json()["id"] for i in range(150)]
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(150) as pool:
            codes = list(pool.map(lambda i: c.get(f"/v1/jobs/{i}", params={"wait": 1.5}).status_code, ids))
        assert codes == [200] * 150
        assert time.monotonic() - t0 < 10


def test_backlog_limit_counts_prefetched_work_and_scales_with_workers(clean_redis: RedisServer) -> None:
    """The 429 limit is backlog_per_process x live worker processes, and messages workers hold but have
    not finished (kombu's `unacked` hash) count as waiting too."""
    import json

    r = clean_redis.client()
    settings = ApiSettings(redis_url=clean_redis.url, backlog_per_process=2)
    with TestClient(create_app(settings)) as c:
        r.hset(keys.UNACKED_KEY, mapping={"tag1": "x"})  # one message prefetched by some worker
        assert c.post("/v1/jobs", json={"texts": ["a"]}).status_code == 202
        refused = c.post("/v1/jobs", json={"texts": ["b"]})  # 1 queued + 1 prefetched >= 2 x 1 process
        assert refused.status_code == 429 and "2 messages waiting" in refused.json()["detail"]
        # A worker with 3 processes starts answering: the limit grows to 6 (after the API's 2 s cache).
        r.zadd(keys.WORKERS_KEY, {"w@test": time.time()})
        r.set(keys.WORKER_INFO_PREFIX + "w@test", json.dumps({"hostname": "w@test", "concurrency": 3,
                                                                 "model": "m", "backend": "torch"}))
        time.sleep(2.1)
        codes = [c.post("/v1/jobs", json={"texts": [f"c{i}"]}).status_code for i in range(5)]
        assert codes == [202, 202, 202, 202, 429]


def test_long_polls_cost_no_pub_sub_command_each(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Long-polls register with the API's one pattern subscription (made once, confirmed before any
    read): no SUBSCRIBE/UNSUBSCRIBE per poll. A GET right after a submit takes the manifest the
    process just wrote from memory: no GET round trip either."""
    r = redis_server.client()
    r.config_resetstat()
    for i in range(5):
        job_id = client.post("/v1/jobs", json={"texts": [f"text {i}"]}).json()["id"]
        assert client.get(f"/v1/jobs/{job_id}", params={"wait": 0.1}).json()["status"] == "queued"
    stats = r.info("commandstats")
    assert "cmdstat_subscribe" not in stats and "cmdstat_unsubscribe" not in stats, stats
    assert stats["cmdstat_psubscribe"]["calls"] == 1, stats
    assert "cmdstat_get" not in stats, stats


def test_a_published_result_wakes_the_long_poll(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A result published on its key's channel (as the workers publish each result they store) answers
    a waiting long-poll. Here it is only published, never stored, so nothing but the pub/sub path can
    deliver it; it is published until the poll answers, as the poll registers at a time the test cannot see."""
    import concurrent.futures
    import json

    r = redis_server.client()
    job_id = client.post("/v1/jobs", json={"texts": ["hello"]}).json()["id"]
    task_id = contract.chunk_task_id(job_id, 0)
    scores = dict.fromkeys(contract.LABELS, 0.25)
    stored = json.dumps(meta.build(meta.SUCCESS, [scores], task_id=task_id, date_done=None, extra={"model": "m"}))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        poll = pool.submit(client.get, f"/v1/jobs/{job_id}", params={"wait": 2})
        while not poll.done():
            r.publish(f"celery-task-meta-{task_id}", stored)
            time.sleep(0.05)
        body = poll.result().json()
    assert body["status"] == "succeeded" and body["results"] == [scores], body
    assert r.get(f"celery-task-meta-{task_id}") is None  # not stored: the pub/sub message answered


def test_get_toxicity_waits_for_the_result_without_reading_it(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """`GET /toxicity` watches its job before sending it, so nothing can be stored before the watch
    began: the published result answers it, and no MGET of the results was sent (the one read the
    compatibility endpoints save per request)."""
    import concurrent.futures

    r = redis_server.client()
    r.config_resetstat()
    scores = dict.fromkeys(contract.LABELS, 0.25)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.get, "/toxicity", params={"q": "hello"})
        while not (queued := r.lrange(contract.QUEUE, 0, -1)):
            time.sleep(0.01)
        task_id = json.loads(queued[0])["headers"]["id"]
        stored = json.dumps(meta.build(meta.SUCCESS, [scores], task_id=task_id, date_done=None, extra={"model": "m"}))
        r.publish(f"celery-task-meta-{task_id}", stored)  # once: the watch began before the message existed
        response = answer.result(timeout=5)
    assert response.status_code == 200 and response.json() == scores, response.text
    assert "cmdstat_mget" not in r.info("commandstats")


def test_get_toxicity_answered_by_the_score_cache_reads_what_the_submit_stored(clean_redis: RedisServer) -> None:
    """A text the score cache holds is answered at submit (stored, never published, no worker): the
    compatibility wait then reads the results at once instead of waiting for a message."""
    r = clean_redis.client()
    pipe = r.pipeline()
    keys.Heartbeat("w@test", model="m", backend="torch", cache=True).write(pipe, time.time())
    pipe.execute()
    scores = dict.fromkeys(contract.LABELS, 0.5)
    ScoreCache(r).put(namespace("m", "torch", contract.TRUNCATE), ["cached text"], [scores])
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, cache=True, compat_timeout=5))) as c:
        t0 = time.monotonic()
        response = c.get("/toxicity", params={"q": "cached text"})
        took = time.monotonic() - t0
    assert response.status_code == 200 and response.json() == scores, response.text
    assert took < 0.9, f"{took:.2f} s: waited for the long-poll's recheck instead of reading"  # RECHECK_SECONDS is 1
    assert r.llen(contract.QUEUE) == 0


def test_the_broker_reuses_one_redis_client_per_channel(clean_redis: RedisServer) -> None:
    """On a redis:// broker the API's Celery app runs toxfleet's transport: kombu's, but one Redis
    client per channel instead of a new one per publish; messages still reach the queue."""
    celery = make_celery(ApiSettings(redis_url=clean_redis.url))
    with celery.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
        channel = conn.default_channel
        assert channel._create_client() is channel._create_client()
    send_messages(celery, [Messages("0" * 32, [["a"], ["b"]], None, time.time())])
    assert clean_redis.client().llen(contract.QUEUE) == 2
    # Sent by queue name, nothing declared on the way (kombu records a declared queue's binding).
    assert clean_redis.client().keys("_kombu.binding.*") == []


def test_concurrent_submits_share_one_send(clean_redis: RedisServer) -> None:
    """Jobs whose submits arrive while a send is due go out together (one thread hop and one Redis
    round trip): 32 submitted at once are two sends, the first alone (nothing was in flight, so it
    went at once) and the other 31 together; each message is in the queue under its own task id, on
    its own lane."""
    celery = make_celery(ApiSettings(redis_url=clean_redis.url))
    publisher = Publisher(celery)
    jobs = [Messages(f"{i:032x}", [[f"text {i}"]], None, time.time(),
                     contract.BULK_QUEUE if i % 4 == 0 else contract.QUEUE) for i in range(32)]

    async def submit_all() -> None:
        await asyncio.gather(*(publisher.send(job) for job in jobs))

    asyncio.run(submit_all())
    assert publisher.sends == 2
    r = clean_redis.client()
    queued = {q: {json.loads(m)["headers"]["id"] for m in r.lrange(q, 0, -1)} for q in contract.QUEUES}
    assert queued[contract.BULK_QUEUE] == {contract.chunk_task_id(j.job_id, 0) for j in jobs[::4]}
    assert queued[contract.QUEUE] == {contract.chunk_task_id(j.job_id, 0) for j in jobs if j not in jobs[::4]}


def test_a_failed_send_fails_every_submit_it_carried() -> None:
    """With Redis unreachable, every submit of the group gets the error (the API answers each 503
    and forgets its job), and a later submit sends again rather than waiting on a dead sender."""
    celery = make_celery(ApiSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout=0.5))
    publisher = Publisher(celery)

    async def submit(n: int) -> list[BaseException | None]:
        jobs = [Messages(f"{i:032x}", [["t"]], None, time.time()) for i in range(n)]
        return await asyncio.gather(*(publisher.send(job) for job in jobs), return_exceptions=True)

    first = asyncio.run(submit(4))
    assert len(first) == 4 and all(isinstance(e, Exception) for e in first), first
    again = asyncio.run(submit(1))
    assert isinstance(again[0], Exception) and publisher.sends == 3  # one alone, three together, one


def test_concurrent_redis_io_shares_one_pipeline_each_with_its_own_replies(clean_redis: RedisServer) -> None:
    """`pipelined`: requests whose commands are due together go in one pipeline round trip (one
    MULTI/EXEC with `transaction`), each getting back the replies of its own commands only; an error
    reaches every request of its group, and the next group runs."""
    from redis import asyncio as aioredis

    from api.coalescer import pipelined

    async def scenario() -> None:
        client = aioredis.Redis.from_url(clean_redis.url)
        writes, reads = pipelined(client, transaction=True), pipelined(client, transaction=False)

        def write(i: int) -> Callable[[Any], None]:
            return lambda pipe: pipe.set(f"k{i}", i).incr("counter")

        replies = await asyncio.gather(*(writes(write(i)) for i in range(20)))
        assert writes.groups == 2 and [r[0] for r in replies] == [True] * 20  # the first alone, then 19
        assert sorted(r[1] for r in replies) == list(range(1, 21))  # INCR replies: each its own
        def read(i: int) -> Callable[[Any], None]:
            return lambda pipe: pipe.mget(f"k{i}", "missing")

        got = await asyncio.gather(*(reads(read(i)) for i in range(20)))
        assert got == [[[str(i).encode(), None]] for i in range(20)] and reads.groups == 2
        failed = await asyncio.gather(reads(lambda pipe: pipe.get("k0")),
                                      reads(lambda pipe: pipe.incr("k1").lpush("k2", "x")),
                                      reads(lambda pipe: pipe.get("k3")), return_exceptions=True)
        assert failed[0] == [b"0"]  # alone, before the others
        assert all(isinstance(e, RedisError) for e in failed[1:]), failed  # WRONGTYPE: the group fails as one
        assert await reads(lambda pipe: pipe.get("k3")) == [b"3"] and reads.groups == 5
        await client.aclose()

    asyncio.run(scenario())
