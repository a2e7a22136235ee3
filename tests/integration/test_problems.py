"""Every error is an RFC 9457 problem (`application/problem+json`, a stable `type` per problem), on the
real app and Redis; Retry-After stays where it was; the client exposes the problem's parts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import ApiSettings
from testing import RedisServer, free_port
from toxfleet.client import Client, InvalidRequest

KEY = "p" * 24


@pytest.fixture
def app_client(clean_redis: RedisServer) -> Iterator[TestClient]:
    settings = ApiSettings(redis_url=clean_redis.url, api_keys=KEY, rate_limit=8,  # type: ignore[arg-type]
                           max_texts=2, max_body_bytes=2048, max_queue_depth=1)
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def problem_of(r: Any, status: int, name: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = r.json()
    assert body["type"] == f"/problems/{name}" and body["status"] == status
    assert body["title"] and isinstance(body["detail"], str) and body["detail"]
    return body


def test_each_problem_has_its_own_type(app_client: TestClient) -> None:
    c = app_client
    problem_of(c.get("/v1/jobs/" + "0" * 32), 404, "not-found")
    problem_of(c.get("/no/such/route"), 404, "not-found")
    problem_of(c.delete("/healthz"), 405, "method-not-allowed")
    unauthorized = c.get("/v1/jobs/" + "0" * 32, headers={"Authorization": ""})
    problem_of(unauthorized, 401, "unauthorized")
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    problem_of(c.post("/v1/jobs", json={"texts": ["x" * 1000] * 3}), 413, "body-too-large")
    assert c.post("/v1/jobs", json={"texts": ["a"]}, headers={"Idempotency-Key": "k1"}).status_code == 202
    problem_of(c.post("/v1/jobs", json={"texts": ["b"]}, headers={"Idempotency-Key": "k1"}), 422,
               "idempotency-mismatch")
    full = c.post("/v1/jobs", json={"texts": ["c"]})  # one message already waits, the limit is one
    problem_of(full, 429, "queue-full")
    assert full.headers["retry-after"] == "5"
    # The 5 counted requests above stay under the limit of 8 per second; 30 more go over it.
    answers = (c.get("/v1/jobs/" + "0" * 32) for _ in range(30))
    limited = next(r for r in answers if r.status_code == 429)
    problem_of(limited, 429, "rate-limited")
    assert limited.headers["retry-after"] == "1"


def test_validation_lists_field_errors_without_echoing_input(clean_redis: RedisServer) -> None:
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, max_text_chars=5))) as c:
        body = problem_of(c.post("/v1/jobs", json={"texts": ["ok", "secret text"], "long_text": "nope"}), 422,
                          "validation")
        assert {tuple(e["loc"]) for e in body["errors"]} == {("body", "long_text")}
        assert all(set(e) == {"loc", "msg", "type"} for e in body["errors"])
        body = problem_of(c.post("/v1/jobs", json={"texts": ["ok", "secret text"]}), 422, "validation")
        assert body["errors"][0]["loc"] == ["body", "texts", 1] and "at most 5 characters" in body["detail"]
        assert "secret text" not in str(body)
        # The drop-in endpoints' errors are problems too; their success shapes are unchanged.
        problem_of(c.get("/toxicity"), 422, "validation")


def test_broker_unavailable_is_a_problem_with_retry_after() -> None:
    settings = ApiSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout=0.3)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/jobs", json={"texts": ["a"]})
        problem_of(r, 503, "broker-unavailable")
        assert r.headers["retry-after"] == "2"


def test_client_exposes_the_problem() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(
        422, headers={"content-type": "application/problem+json"},
        json={"type": "/problems/validation", "title": "t", "status": 422, "detail": "texts: too many",
              "errors": [{"loc": ["body", "texts"], "msg": "too many", "type": "too_long"}]}))
    with Client("http://test", transport=transport) as c, pytest.raises(InvalidRequest) as caught:
        c.submit(["x"])
    assert caught.value.problem_type == "/problems/validation" and caught.value.detail == "texts: too many"
    assert caught.value.errors == [{"loc": ["body", "texts"], "msg": "too many", "type": "too_long"}]
