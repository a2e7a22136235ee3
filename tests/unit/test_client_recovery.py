"""The client's end-to-end at-least-once, as pure logic: a job the server no longer knows (404 after
its 202), or one stuck while the fleet is ready, is submitted again under the same Idempotency-Key,
or a key derived from it when the server still maps that key to the lost job. The HTTP peer is a
small in-memory stand-in (httpx.MockTransport); the real fleet losing Redis is tests/integration/
test_client_recovery.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from toxfleet import client as tc


@dataclass
class Server:
    """Jobs by id and Idempotency-Keys, like the API; `lose()` forgets jobs (and, optionally, keys)."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    posts: list[str] = field(default_factory=list)
    ready: bool = True
    finish: bool = True
    problem_json: bool = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200 if self.ready else 503,
                                  json={"status": "ready" if self.ready else "unavailable", "workers": 1})
        if request.method == "POST":
            key = request.headers["idempotency-key"]
            self.posts.append(key)
            if key not in self.keys:
                job_id = f"job{len(self.jobs) + len(self.posts)}"
                texts = json.loads(request.content)["texts"]
                self.jobs[job_id] = {"id": job_id, "status": "queued", "texts": texts}
                self.keys[key] = job_id
            return httpx.Response(202, json={"id": self.keys[key], "status": "queued"})
        job_id = request.url.path.rsplit("/", 1)[1]
        job = self.jobs.get(job_id)
        if job is None:
            if self.problem_json:
                return httpx.Response(404, headers={"content-type": "application/problem+json"},
                                      json={"type": "about:blank", "title": "Not Found", "status": 404,
                                            "detail": f"job {job_id}: unknown"})
            return httpx.Response(404, json={"detail": "unknown, or expired"})
        if not self.finish:
            return httpx.Response(200, json={"id": job_id, "status": "queued", "results": None,
                                             "progress": {"done": 0, "total": 1}})
        results = [{"toxicity": float(len(t))} for t in job["texts"]]
        return httpx.Response(200, json={"id": job_id, "status": "succeeded", "results": results,
                                         "progress": {"done": 1, "total": 1}})


def client(server: Server, **kwargs: Any) -> tc.Client:
    return tc.Client("http://t", transport=httpx.MockTransport(server.handle), poll_wait=0.01, **kwargs)


@pytest.mark.parametrize("problem_json", [False, True])
def test_a_job_lost_with_the_broker_is_submitted_again_under_its_key(problem_json: bool) -> None:
    """Redis restarted empty: the job and its key are gone; wait() resubmits under the same key and
    returns the new job's results (an RFC 9457 problem body reads the same)."""
    server = Server(problem_json=problem_json)
    with client(server) as c:
        job = c.submit(["ab", "c"])
        first = job.id
        server.jobs.clear()
        server.keys.clear()
        status = job.wait(timeout=5)
    assert [r["toxicity"] for r in status.results or []] == [2.0, 1.0]
    assert job.id != first and job.resubmitted == 1
    assert server.posts[0] == server.posts[1]  # the same Idempotency-Key


def test_a_key_still_mapped_to_the_lost_job_gets_a_derived_key() -> None:
    """Only the job vanished (its key survived): the same key replays the lost job, so the client
    asks again under a key derived from it, once."""
    server = Server()
    with client(server) as c:
        job = c.submit(["x"])
        del server.jobs[job.id]
        status = job.wait(timeout=5)
    assert status.status == "succeeded"
    assert server.posts == [server.posts[0], server.posts[0], server.posts[0] + ".1"]


def test_a_stuck_job_is_resubmitted_only_while_the_fleet_is_ready() -> None:
    """No progress for stall_after seconds: resubmitted when /readyz reports workers, not while the
    fleet is away (then the job is waiting, not stuck)."""
    server = Server(finish=False, ready=False)
    with client(server, stall_after=0.05) as c:
        job = c.submit(["x"])
        with pytest.raises(tc.JobTimeout):
            job.wait(timeout=0.5)
        assert job.resubmitted == 0
        server.ready = True
        with pytest.raises(tc.JobTimeout):
            job.wait(timeout=0.5)
    assert job.resubmitted >= 1 and server.posts[1:3] == [server.posts[0], server.posts[0] + ".1"]


def test_a_job_handle_without_its_submission_still_raises_not_found() -> None:
    """`client.job(id)` knows no body to resubmit: an unknown job is JobNotFound, as before."""
    with client(Server()) as c, pytest.raises(tc.JobNotFound):
        c.job("nope").wait(timeout=1)


def test_async_client_resubmits_a_lost_job_and_keeps_order() -> None:
    """AsyncClient.score over several jobs, one lost after its 202: every result, in input order."""
    server = Server()
    lost = False

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal lost
        if request.method == "GET" and not lost and request.url.path.startswith("/v1/jobs/"):
            lost = True
            server.jobs.pop(request.url.path.rsplit("/", 1)[1])
        return server.handle(request)

    async def go() -> list[tc.Result]:
        async with tc.AsyncClient("http://t", transport=httpx.MockTransport(handle), poll_wait=0.01) as c:
            return await c.score(["a" * n for n in range(1, 11)], job_size=3)

    assert [r["toxicity"] for r in asyncio.run(go())] == [float(n) for n in range(1, 11)]
