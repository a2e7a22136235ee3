"""API keys, per-key rate limits, idempotent submits and body-size limits, on the real app and Redis."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from api.auth import key_id
from api.deps import get_caller
from api.main import create_app
from api.routes import jobs
from api.settings import ApiSettings
from fleet import keys
from testing import RedisServer
from toxfleet import contract

KEY = "k" * 24
OTHER = "o" * 24


@pytest.fixture
def keyed(clean_redis: RedisServer) -> Iterator[TestClient]:
    settings = ApiSettings(redis_url=clean_redis.url, api_keys=f"{KEY},{OTHER}", rate_limit=5)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        yield c


def test_keys_required_when_configured(keyed: TestClient) -> None:
    """With keys on, job and scoring routes answer 401 without a valid bearer key."""
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": KEY}):
        r = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/toxicity", params={"q": "a"}).status_code == 401
    assert keyed.get("/v1/jobs/" + "0" * 32).status_code == 401
    ok = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 202


def test_key_read_from_the_header_as_bearer_would(keyed: TestClient) -> None:
    """The key is read from the header without FastAPI's HTTPBearer dependency (issue 11), with its rules:
    the scheme in any case, another scheme or an empty token refused, and no sub-dependency left to solve."""
    def submit(authorization: str) -> int:
        return keyed.post("/v1/jobs", json={"texts": ["a"]}, headers={"Authorization": authorization}).status_code

    assert [submit(f"{scheme} {KEY}") for scheme in ("Bearer", "bearer", "BEARER")] == [202] * 3
    assert [submit(value) for value in (f"Basic {KEY}", "Bearer ", "Bearer")] == [401] * 3
    route = next(r for r in jobs.router.routes if isinstance(r, APIRoute) and r.endpoint is jobs.submit_job)
    caller = next(d for d in route.dependant.dependencies if d.call is get_caller)
    assert caller.dependencies == []


def test_health_and_docs_stay_open(keyed: TestClient) -> None:
    """Health endpoints and the OpenAPI docs need no key."""
    for path in ("/healthz", "/readyz", "/healthcheck", "/healthcheck/loadbalancer", "/openapi.json"):
        assert keyed.get(path).status_code == 200, path


def test_rate_limit_per_key(keyed: TestClient) -> None:
    """Past the per-second limit a key gets 429 with Retry-After; another key is unaffected."""
    auth = {"Authorization": f"Bearer {KEY}"}
    codes = [keyed.get("/v1/jobs/" + "0" * 32, headers=auth).status_code for _ in range(12)]
    assert 429 in codes and codes[0] == 404
    limited = keyed.get("/v1/jobs/" + "0" * 32, headers=auth)
    if limited.status_code == 429:
        assert limited.headers["retry-after"] == "1"
    assert keyed.get("/v1/jobs/" + "0" * 32, headers={"Authorization": f"Bearer {OTHER}"}).status_code == 404


def test_short_keys_are_refused_at_start() -> None:
    """A configured key under 16 characters stops the API at start."""
    with pytest.raises(ValueError, match="16 characters"):
        ApiSettings(api_keys="short")  # type: ignore[arg-type]


@pytest.fixture
def client(clean_redis: RedisServer) -> Iterator[TestClient]:
    with TestClient(create_app(ApiSettings(redis_url=clean_redis.url, max_body_bytes=2048))) as c:
        yield c


def test_idempotency_key_returns_the_same_job(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A retried POST with the same Idempotency-Key and body gets the same job; nothing is enqueued twice."""
    h = {"Idempotency-Key": "order-42"}
    first = client.post("/v1/jobs", json={"texts": ["a", "b"]}, headers=h)
    again = client.post("/v1/jobs", json={"texts": ["a", "b"]}, headers=h)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert redis_server.client().llen(contract.QUEUE) == 1


def test_idempotency_key_with_other_body_is_422(client: TestClient) -> None:
    """Reusing a key for a different request is an error, not a silent replay."""
    h = {"Idempotency-Key": "order-43"}
    assert client.post("/v1/jobs", json={"texts": ["a"]}, headers=h).status_code == 202
    r = client.post("/v1/jobs", json={"texts": ["b"]}, headers=h)
    assert r.status_code == 422 and "different request body" in r.json()["detail"]


def test_concurrent_twins_create_one_job(client: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Ten simultaneous POSTs with one key yield one job id and one queued message."""
    def post(_: int) -> str:
        r = client.post("/v1/jobs", json={"texts": ["twin"]}, headers={"Idempotency-Key": "twins"})
        job_id: str = r.json()["id"]
        return job_id

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        ids = set(pool.map(post, range(10)))
    assert len(ids) == 1
    assert redis_server.client().llen(contract.QUEUE) == 1
    # The losers' jobs were never sent: nothing of theirs is left for the sweeper to send.
    job_id = next(iter(ids))
    assert redis_server.client().zrange(keys.PENDING_KEY, 0, -1) == [contract.chunk_task_id(job_id, 0).encode()]
    assert redis_server.client().hkeys(keys.PENDING_ARGS_KEY) == [contract.chunk_task_id(job_id, 0).encode()]
    assert client.get(f"/v1/jobs/{ids.pop()}").json()["status"] == "queued"


def test_idempotency_key_too_long_is_422(client: TestClient) -> None:
    """Keys are at most 255 characters."""
    assert client.post("/v1/jobs", json={"texts": ["a"]}, headers={"Idempotency-Key": "x" * 256}).status_code == 422


def test_body_over_limit_is_413(client: TestClient) -> None:
    """A body over max_body_bytes is refused with 413, whether it declares its length or streams it."""
    big = {"texts": ["x" * 1000] * 3}
    r = client.post("/v1/jobs", json=big)
    assert r.status_code == 413 and "larger than 2048" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:
        yield b'{"texts": ["'
        for _ in range(10):
            yield b"y" * 500
        yield b'"]}'

    streamed = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


def test_a_job_is_visible_only_to_the_key_that_created_it(keyed: TestClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Another key gets 404 (as for a missing job); the manifest stores a hash of the key, never the key."""
    mine, theirs = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {OTHER}"}
    job_id = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers=mine).json()["id"]
    assert keyed.get(f"/v1/jobs/{job_id}", headers=mine).status_code == 200
    other = keyed.get(f"/v1/jobs/{job_id}", headers=theirs)
    assert other.status_code == 404 and other.json()["type"] == "/problems/not-found"
    manifest = redis_server.client().get(keys.job_key(job_id)).decode()
    assert KEY not in manifest and json.loads(manifest)["owner"] == key_id(KEY)


def test_idempotency_keys_are_scoped_per_api_key(keyed: TestClient) -> None:
    """The same Idempotency-Key under two API keys makes two jobs, each replayed to its own key only."""
    mine, theirs = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": "same"}, \
        {"Authorization": f"Bearer {OTHER}", "Idempotency-Key": "same"}
    first = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers=mine).json()["id"]
    second = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers=theirs).json()["id"]
    assert first != second
    replay = keyed.post("/v1/jobs", json={"texts": ["a"]}, headers=mine)
    assert replay.json()["id"] == first and replay.headers["idempotent-replayed"] == "true"


def test_openapi_declares_bearer_auth_on_protected_routes(keyed: TestClient) -> None:
    spec = keyed.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": "An API key from `TOXFLEET_API_KEYS` (when it is set)."}
    for path, method in (("/v1/jobs", "post"), ("/v1/jobs/{job_id}", "get"), ("/toxicity", "get"),
                         ("/toxicity/batch", "post")):
        assert spec["paths"][path][method]["security"] == [{"HTTPBearer": []}], path
    assert "security" not in spec["paths"]["/healthz"]["get"]
