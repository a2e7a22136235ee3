"""Client logic that needs no fleet: retries honour Retry-After and keep the Idempotency-Key, errors
map to clear exceptions, results parse to typed values. The HTTP peer here is httpx.MockTransport;
the client against the real API is tested in test_bulk.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from toxfleet import client as tc
from toxfleet.client.protocol import parse_job

JOB = "a" * 32
DONE = {"id": JOB, "status": "succeeded", "results": [{"toxicity": 0.9, "insult": 0.1}], "model": "m",
        "error": None, "progress": {"done": 1, "total": 1},
        "flags": [{"flagged": True, "labels": {"toxicity": True, "insult": False}}], "cache_hits": 1}


def client(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> tc.Client:
    return tc.Client("http://toxfleet.test", api_key="k" * 16, transport=httpx.MockTransport(handler), **kwargs)


def test_submit_retries_429_after_retry_after_with_the_same_idempotency_key() -> None:
    """A 429 is retried after its Retry-After, with the same Idempotency-Key and the bearer key."""
    seen: list[tuple[float, str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((time.monotonic(), request.headers["idempotency-key"], request.headers["authorization"]))
        if len(seen) == 1:
            return httpx.Response(429, headers={"retry-after": "1"}, json={"detail": "queue is full"})
        return httpx.Response(202, json={"id": JOB, "status": "queued", "url": f"/v1/jobs/{JOB}"})

    with client(handler) as c:
        job = c.submit(["x"])
    assert job.id == JOB and len(seen) == 2
    assert seen[1][0] - seen[0][0] >= 1.0
    assert seen[0][1] == seen[1][1] and seen[0][2] == "Bearer " + "k" * 16


def test_unavailable_after_retry_budget() -> None:
    """A server that stays 503 (or unreachable) raises Unavailable once retry_for is spent."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"retry-after": "0"}, json={"detail": "broker unavailable"})

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    for h in (handler, unreachable):
        with client(h, retry_for=0.3) as c, pytest.raises(tc.Unavailable):
            c.submit(["x"])


@pytest.mark.parametrize(("status", "kind"), [(401, tc.Unauthorized), (404, tc.JobNotFound),
                                              (422, tc.InvalidRequest), (413, tc.InvalidRequest)])
def test_errors_map_to_exceptions(status: int, kind: type[Exception]) -> None:
    """Client errors are not retried and raise a specific exception carrying the server's detail."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(status, json={"detail": "nope"})

    with client(handler) as c, pytest.raises(kind, match="nope"):
        c.job(JOB).status()
    assert len(calls) == 1


def test_wait_long_polls_and_parses_typed_results() -> None:
    """wait() asks the server to hold (?wait=), then returns typed results with flags and cache hits."""
    waits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        waits.append(request.url.params.get("wait", ""))
        if len(waits) < 2:
            return httpx.Response(200, json={**DONE, "status": "running", "results": None, "flags": None})
        return httpx.Response(200, json=DONE)

    with client(handler, poll_wait=0.01) as c:
        status = c.job(JOB).wait(timeout=5)
    assert waits[0] == "0.010"
    assert status.results == [tc.Result({"toxicity": 0.9, "insult": 0.1}, True, {"toxicity": True, "insult": False})]
    assert status.results[0]["toxicity"] == 0.9 and status.cache_hits == 1 and status.model == "m"


def test_failed_job_and_timeout_raise() -> None:
    """A failed job raises JobFailed with the server's reason; an unfinished one JobTimeout."""
    def failed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**DONE, "status": "failed", "results": None, "error": "ValueError: bad"})

    def running(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**DONE, "status": "running", "results": None})

    with client(failed) as c, pytest.raises(tc.JobFailed, match="ValueError: bad"):
        c.job(JOB).wait(timeout=1)
    with client(running, poll_wait=0.05) as c, pytest.raises(tc.JobTimeout):
        c.job(JOB).wait(timeout=0.2)


def test_split_respects_counts_and_characters() -> None:
    """score() splits by text count and by characters, keeping order."""
    texts = [str(i) * (i % 5 + 1) for i in range(100)]
    batches = tc.split(texts, job_size=7, job_chars=20)
    assert [t for b in batches for t in b] == texts
    assert all(len(b) <= 7 and (len(b) == 1 or sum(map(len, b)) <= 20) for b in batches)


def test_old_server_without_flags_still_parses() -> None:
    """A server that predates flags gives results with flagged None (not an error)."""
    body = {k: v for k, v in DONE.items() if k not in ("flags", "cache_hits")}
    status = parse_job(body)
    assert status.results is not None and status.results[0].flagged is None and status.cache_hits == 0


def test_async_client_retries_and_waits() -> None:
    """AsyncClient: same retry on 503 and the same long-poll and parsing."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if request.method == "POST":
            if calls.count("POST") == 1:
                return httpx.Response(503, headers={"retry-after": "0"}, json={"detail": "later"})
            return httpx.Response(202, json={"id": JOB, "status": "queued", "url": "x"})
        return httpx.Response(200, json=DONE)

    async def go() -> list[tc.Result]:
        async with tc.AsyncClient("http://t", transport=httpx.MockTransport(handler)) as c:
            return await c.score(["x"])

    assert asyncio.run(go())[0]["toxicity"] == 0.9
    assert calls == ["POST", "POST", "GET"]


def test_score_sends_bulk_and_submit_the_server_default() -> None:
    """`score()` (so `toxfleet score`) is a backfill: it sends priority bulk; `submit()` sends none
    (the server's default, interactive) unless asked."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            bodies.append(json.loads(request.content))
            return httpx.Response(202, json={"id": JOB, "status": "queued", "url": f"/v1/jobs/{JOB}"})
        return httpx.Response(200, json=DONE)

    with client(handler) as c:
        c.score(["x"])
        c.submit(["x"])
        c.submit(["x"], priority="interactive")
    assert [b.get("priority") for b in bodies] == ["bulk", None, "interactive"]
