"""README promises, each through the real uvicorn server (and a real worker where one is needed):
expiry at `expires_at`, `TOXFLEET_IDEMPOTENCY_TTL`, the drop-in endpoints' 502 and 504 problems, a job
that another API key can neither delete nor long-poll, a job Redis lost answered 404 at once,
`rediss://` and `unix://` end to end, and auth, 413 and the rate limit as uvicorn serves them."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from scripts.redis_server import server_binary
from testing import Fleet, FleetSpec, Proc, RedisServer, free_port, start_api, start_worker, wait_for

ALICE, BOB = "promises-alice-0123456789", "promises-bob-0123456789"
KEYS = f"{ALICE},{BOB}"
EXPIRES = 60
"""Seconds jobs are kept by the fleet's API here (the setting's floor), and an Idempotency-Key by `keyed`'s."""
WORKER_MAX_CHARS = 40
"""The worker refuses texts longer than this while the API accepts them (limits set apart, as in a
rollout that changed one tier): the worker fails such a job, a failure the API did not foresee."""

FLEET = FleetSpec("promises", db=13, worker_env={"TOXFLEET_MAX_TEXT_CHARS": str(WORKER_MAX_CHARS)},
                  api_env={"TOXFLEET_API_KEYS": KEYS, "TOXFLEET_RESULT_EXPIRES": str(EXPIRES),
                           "TOXFLEET_COMPAT_TIMEOUT": "30", "TOXFLEET_BACKLOG_PER_PROCESS": "10000"})


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def problem(r: httpx.Response, status: int, name: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body: dict[str, Any] = r.json()
    assert body["type"] == f"/problems/{name}" and body["status"] == status, body
    return body


def unix_time(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339).timestamp()


@pytest.fixture(scope="module")
def keyed(fleet: Fleet, session_tmp: Path) -> Iterator[str]:
    """A second API process on the fleet's Redis: Idempotency-Keys kept `EXPIRES` seconds, jobs a day."""
    proc, url = start_api(session_tmp, fleet.redis_url, name="promises-keyed", TOXFLEET_API_KEYS=KEYS,
                          TOXFLEET_IDEMPOTENCY_TTL=str(EXPIRES), TOXFLEET_BACKLOG_PER_PROCESS="10000")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def edge(redis_server: RedisServer, session_tmp: Path) -> Iterator[str]:
    """An API on a database no worker reads, with a 1 s drop-in timeout, a rate limit and a small body limit."""
    proc, url = start_api(session_tmp, redis_server.flush(14), name="promises-edge", TOXFLEET_API_KEYS=KEYS,
                          TOXFLEET_COMPAT_TIMEOUT="1", TOXFLEET_RATE_LIMIT="5", TOXFLEET_MAX_BODY_BYTES="2048")
    yield url
    proc.stop()


def test_a_job_is_a_404_after_expires_at_and_a_key_starts_a_new_job_after_the_idempotency_ttl(
        fleet: Fleet, keyed: str) -> None:
    """One clock for both: the fleet's API keeps jobs `EXPIRES` seconds, `keyed` keeps Idempotency-Keys
    as long (and jobs a day). The job answers until `expires_at`, then 404 (GET and long-poll alike);
    the key replays its job until its TTL, then starts a new one while the first job still exists (so
    the key's own TTL ended it, not its job's expiry)."""
    with httpx.Client(base_url=fleet.url, headers=as_(ALICE), timeout=30) as api, \
            httpx.Client(base_url=keyed, headers=as_(ALICE), timeout=30) as api_keyed:
        job = api.get(api.post("/v1/jobs", json={"texts": ["expires soon"]}).headers["location"],
                      params={"wait": 20}).json()
        assert job["status"] == "succeeded", job
        expires_at = unix_time(job["expires_at"])
        assert expires_at - unix_time(job["created_at"]) == pytest.approx(EXPIRES, abs=0.01)

        def submit_with_key() -> httpx.Response:
            r = api_keyed.post("/v1/jobs", json={"texts": ["keyed"]}, headers={"Idempotency-Key": "promise-key"})
            assert r.status_code == 202, r.text
            return r

        first = submit_with_key()
        key_set = time.time()  # the key's TTL started at most this long ago
        replay = submit_with_key()
        assert replay.json()["id"] == first.json()["id"] and replay.headers["idempotent-replayed"] == "true"

        time.sleep(max(0.0, min(expires_at, key_set + EXPIRES) - 3 - time.time()))
        assert api.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
        late = submit_with_key()  # three seconds before the key's TTL: still the same job
        assert late.json()["id"] == first.json()["id"] and late.headers["idempotent-replayed"] == "true"

        while (r := api.get(f"/v1/jobs/{job['id']}")).status_code == 200:
            assert time.time() < expires_at + 2, "still answering 2 s after expires_at"
            time.sleep(0.1)
        assert time.time() >= expires_at - 0.2  # Redis expired it at expires_at, not before
        problem(r, 404, "not-found")
        problem(api.get(f"/v1/jobs/{job['id']}", params={"wait": 1}), 404, "not-found")

        time.sleep(max(0.0, key_set + EXPIRES + 1 - time.time()))
        fresh = submit_with_key()
        assert fresh.json()["id"] != first.json()["id"] and "idempotent-replayed" not in fresh.headers
        assert api_keyed.get(first.headers["location"]).status_code == 200  # the first job is still there
        again = submit_with_key()
        assert again.json()["id"] == fresh.json()["id"] and again.headers["idempotent-replayed"] == "true"


def test_a_deleted_jobs_idempotency_key_starts_a_new_job(fleet: Fleet) -> None:
    """Once its job is deleted, a retried Idempotency-Key makes a new job, where it used to answer 202
    with the deleted job's id, whose GET was then a 404 (found by schemathesis's stateful phase)."""
    with httpx.Client(base_url=fleet.url, headers={**as_(ALICE), "Idempotency-Key": "deleted-key"},
                      timeout=30) as api:
        first = api.post("/v1/jobs", json={"texts": ["to delete"]})
        assert first.status_code == 202 and api.delete(first.headers["location"]).status_code == 204
        second = api.post("/v1/jobs", json={"texts": ["to delete"]})
        assert second.status_code == 202 and "idempotent-replayed" not in second.headers, second.headers
        assert second.json()["id"] != first.json()["id"]
        assert api.get(second.headers["location"], params={"wait": 20}).json()["status"] == "succeeded"
        replay = api.post("/v1/jobs", json={"texts": ["to delete"]})
        assert replay.json()["id"] == second.json()["id"] and replay.headers["idempotent-replayed"] == "true"


def test_drop_in_endpoints_answer_502_when_the_workers_fail_the_job(fleet: Fleet) -> None:
    """A text the worker refuses (longer than its limit, within the API's) fails the job in the worker:
    `/toxicity` and `/toxicity/batch` answer 502 `/problems/scoring-failed` with the worker's reason; a
    text the worker takes still scores (the worker is fine)."""
    long_text = "x" * (WORKER_MAX_CHARS + 10)
    with httpx.Client(base_url=fleet.url, headers=as_(ALICE), timeout=60) as api:
        assert api.get("/toxicity", params={"q": "short"}).status_code == 200
        body = problem(api.get("/toxicity", params={"q": long_text}), 502, "scoring-failed")
        assert f"{len(long_text)} characters > {WORKER_MAX_CHARS}" in body["detail"], body
        body = problem(api.post("/toxicity/batch", json=["short", long_text]), 502, "scoring-failed")
        assert f"texts[1] has {len(long_text)} characters" in body["detail"], body


def test_drop_in_endpoints_answer_504_when_no_result_comes_in_time(edge: str) -> None:
    """No worker reads `edge`'s queue: after `TOXFLEET_COMPAT_TIMEOUT` (1 s) the drop-in endpoints answer
    504 `/problems/scoring-timeout`, naming the job, which goes on (queued)."""
    with httpx.Client(base_url=edge, headers=as_(ALICE), timeout=30) as api:
        for request in (lambda: api.get("/toxicity", params={"q": "nobody scores this"}),
                        lambda: api.post("/toxicity/batch", json=["nor this", "nor that"])):
            started = time.monotonic()
            body = problem(request(), 504, "scoring-timeout")
            assert 1.0 <= time.monotonic() - started < 5, time.monotonic() - started
            job_url = body["detail"].rsplit("see ", 1)[1]
            assert api.get(job_url).json()["status"] == "queued"


def test_a_job_redis_lost_is_a_404_at_once_though_the_api_just_wrote_it(edge: str, redis_server: RedisServer
                                                                       ) -> None:
    """Redis loses its data (restarted empty, a failover to a replica that never saw the job) right after
    a submit: the API that wrote the job, which holds its manifest for a few seconds
    (`api.services.manifests`), answers 404, plain GET and long-poll alike, never `queued`."""
    with httpx.Client(base_url=edge, headers=as_(BOB), timeout=30) as api:
        submitted = api.post("/v1/jobs", json={"texts": ["lost with the broker"]})
        assert submitted.status_code == 202, submitted.text
        location = submitted.headers["location"]
        assert api.get(location).json()["status"] == "queued"
        redis_server.flush(14)
        problem(api.get(location), 404, "not-found")
        problem(api.get(location, params={"wait": 2}), 404, "not-found")


def test_another_key_can_neither_delete_nor_long_poll_a_job(fleet: Fleet) -> None:
    """Bob's DELETE of Alice's job is a 404 that deletes nothing (workers still score it), and his
    long-poll on it is a 404 at once, not a wait; Alice's own delete then works."""
    with httpx.Client(base_url=fleet.url, headers=as_(ALICE), timeout=60) as alice, \
            httpx.Client(base_url=fleet.url, headers=as_(BOB), timeout=60) as bob:
        location = alice.post("/v1/jobs", json={"texts": ["mine", "all mine"]}).headers["location"]
        problem(bob.delete(location), 404, "not-found")
        started = time.monotonic()
        problem(bob.get(location, params={"wait": 5}), 404, "not-found")
        assert time.monotonic() - started < 2  # refused before waiting
        job = alice.get(location, params={"wait": 20}).json()
        assert job["status"] == "succeeded" and len(job["results"]) == 2, job
        problem(bob.delete(location), 404, "not-found")
        assert alice.get(location).status_code == 200  # a finished job is not Bob's to delete either
        assert alice.delete(location).status_code == 204
        problem(alice.get(location), 404, "not-found")


def test_auth_body_limit_and_rate_limit_as_uvicorn_serves_them(edge: str) -> None:
    """401 without a key or with a wrong one (with `WWW-Authenticate`), 413 for a body over the limit
    whether its length is declared or it comes chunked, and 429 `rate-limited` with Retry-After once a
    key goes over 5 requests in a second; the next second it is served again."""
    job = "/v1/jobs/" + "0" * 32
    with httpx.Client(base_url=edge, timeout=30) as http:
        for headers in ({}, as_("wrong-key-wrong-key-wrong")):
            r = http.get(job, headers=headers)
            problem(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
        body = b'{"texts": ["' + b"x" * 3000 + b'"]}'
        problem(http.post("/v1/jobs", content=body, headers={**as_(ALICE), "content-type": "application/json"}),
                413, "body-too-large")

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(body), 500):
                yield body[i:i + 500]

        chunked = http.post("/v1/jobs", content=chunks(), headers={**as_(ALICE), "content-type": "application/json"})
        assert chunked.request.headers.get("transfer-encoding") == "chunked"
        problem(chunked, 413, "body-too-large")

        answers = [http.get(job, headers=as_(BOB)) for _ in range(20)]  # 20 requests: one second holds > 5
        limited = [r for r in answers if r.status_code == 429]
        assert limited and all(r.status_code in (404, 429) for r in answers), [r.status_code for r in answers]
        problem(limited[0], 429, "rate-limited")
        assert limited[0].headers["retry-after"] == "1"
        time.sleep(1.1)
        problem(http.get(job, headers=as_(BOB)), 404, "not-found")


# --- rediss:// and unix:// -------------------------------------------------------------------------


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA, and a server certificate for 127.0.0.1 it signed: (ca, cert, key)."""
    ca, ca_key, cert, key, csr = (directory / n for n in ("ca.crt", "ca.key", "server.crt", "server.key",
                                                          "server.csr"))
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
         "-subj", "/CN=toxfleet-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "1",
         "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True, timeout=60)
    return ca, cert, key


@pytest.fixture
def tls_and_socket_redis(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """One Redis listening on a Unix socket and on a TLS port only (no plain TCP): its `unix://` and
    `rediss://` URLs. Skipped, saying why, where the server binary has no TLS or there is no openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make the test's certificates")
    ca, cert, key = _certificates(tmp_path)
    # A short directory of its own: a socket path may not exceed ~107 bytes, and pytest's may.
    socket, port = Path(tempfile.mkdtemp(prefix="tf-")) / "redis.sock", free_port()
    log = tmp_path / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([server_binary(), "--port", "0", "--bind", "127.0.0.1", "--unixsocket", str(socket),
                                 "--unixsocketperm", "700", "--tls-port", str(port), "--tls-cert-file", str(cert),
                                 "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                                 "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        unix = f"unix://{socket}?db=0"
        try:
            wait_for(lambda: proc.poll() is None and bool(redis.Redis.from_url(unix).ping()), 10, "redis on a socket")
        except TimeoutError:
            if proc.poll() is not None and "tls" in log.read_text().lower():
                pytest.skip(f"{server_binary()} was built without TLS: {log.read_text().strip()[-300:]}")
            raise
        yield unix, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"  # verified by default
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(socket.parent, ignore_errors=True)


@pytest.mark.slow
def test_rediss_and_unix_socket_urls_run_the_fleet_end_to_end(
        tls_and_socket_redis: tuple[str, str], tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    """A worker and the API on one Redis, each tier once over TLS (the certificate verified against the
    test's CA, by default) and once over the Unix socket: jobs and `/toxicity` are scored, `/readyz`
    sees the worker; without the CA the API refuses the server."""
    unix, tls = tls_and_socket_redis
    for worker_url, api_url, name in ((tls, unix, "w-tls"), (unix, tls, "w-unix")):
        procs: list[Proc] = []
        try:
            procs.append(start_worker(tmp_path, worker_url, tiny_checkpoint, name=name, concurrency=1))
            api, url = start_api(tmp_path, api_url, name=f"{name}-api")
            procs.append(api)
            with httpx.Client(base_url=url, timeout=60) as http:
                location = http.post("/v1/jobs", json={"texts": ["over", "the wire"]}).headers["location"]
                job = http.get(location, params={"wait": 30}).json()
                assert job["status"] == "succeeded" and len(job["results"]) == 2, (name, job)
                assert set(http.get("/toxicity", params={"q": name}).json()) == set(job["results"][0]), name
                assert http.get("/readyz").json()["workers"] == 1, name
        finally:
            for proc in reversed(procs):
                proc.stop()
    # Verified, not only encrypted: without the test's CA the same server's certificate is refused.
    api, url = start_api(tmp_path, tls.split("?")[0], name="untrusted-api")
    try:
        assert httpx.get(url + "/readyz", timeout=10).status_code == 503
    finally:
        api.stop()
