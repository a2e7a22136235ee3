"""The asyncio client: `AsyncClient` and its `AsyncJob` handles, the same methods as coroutines."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import httpx

import toxfleet.client.protocol as protocol
from toxfleet.client.results import BatchOutcome, InvalidRequest, JobFailed, JobNotFound, JobStatus, Result


class AsyncJob:
    """A submitted job: `await wait()` for it, or `await status()` for where it is now."""

    def __init__(self, client: AsyncClient, job_id: str, submission: protocol.Submission | None = None) -> None:
        self.client = client
        self.id = job_id
        self.submission = submission
        self.resubmitted = 0

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self) -> JobStatus:
        return await self.client.job_status(self.id)

    async def wait(self, timeout: float | None = None) -> JobStatus:
        """Long-poll until the job finishes; the succeeded status, JobFailed, or JobTimeout after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        progress = protocol.Progress(self.client.stall_after)
        while True:
            hold = max(0.0, min(self.client.poll_wait, protocol.remaining(deadline)))
            started = time.monotonic()
            try:
                status = await self.client.job_status(self.id, wait=hold)
            except JobNotFound:
                if self.submission is None:
                    raise
                # Accepted, then unknown: the broker lost it (a Redis restarted empty, a failover).
                await self._resubmit("is unknown to the server (lost with the broker)")
                progress.reset()
                continue
            if protocol.settled(status, deadline, timeout):
                return status
            if self.submission is not None and progress.stalled(status) and await self.client.fleet_ready():
                await self._resubmit(f"made no progress for {self.client.stall_after:g}s while the fleet was ready")
                progress.reset()
                continue
            if (pause := protocol.early_pause(started, hold, attempt, deadline)) is not None:
                await asyncio.sleep(pause)
                attempt += 1

    async def _resubmit(self, why: str) -> None:
        assert self.submission is not None
        while not self.submission.answered(self.id, new := await self.client._send(self.submission), why):
            pass
        self.id = new
        self.resubmitted += 1


class AsyncClient:
    """asyncio client, same methods as `Client` as coroutines. Use `async with`, or `await aclose()`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = protocol.DEFAULT_TIMEOUT,
                 poll_wait: float = protocol.DEFAULT_POLL_WAIT, retry_for: float = protocol.DEFAULT_RETRY_FOR,
                 stall_after: float | None = protocol.DEFAULT_STALL_AFTER,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = protocol.default_headers(api_key)
        self.poll_wait = poll_wait
        self.retry_for = retry_for
        self.stall_after = stall_after
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                       transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_for
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = await self._http.request(method, url, **kwargs)
                problem = protocol.problem_of(response)
                if problem is None:
                    return response
            except httpx.TransportError as exc:
                problem = exc
            await asyncio.sleep(protocol.retry_delay(attempt, response, problem, deadline, f"{method} {url}",
                                                     self.retry_for))
            attempt += 1

    async def submit(self, texts: Sequence[str], *, long_text: str | None = None,
                     thresholds: float | Mapping[str, float] | None = None,
                     priority: str | None = None) -> AsyncJob:
        """Enqueue texts for scoring; see `Client.submit`."""
        submission = protocol.Submission(protocol.submit_body(texts, long_text, thresholds, priority), uuid.uuid4().hex)
        return AsyncJob(self, await self._send(submission), submission)

    async def _send(self, submission: protocol.Submission) -> str:
        response = await self._request("POST", "/v1/jobs", json=submission.body, headers=submission.headers())
        job_id: str = response.json()["id"]
        return job_id

    async def fleet_ready(self) -> bool:
        """Whether the broker answers and workers are beating (`/readyz`), asked once without retries."""
        try:
            return protocol.fleet_ready(await self._http.get("/readyz"))
        except httpx.HTTPError:
            return False

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def job_status(self, job_id: str, wait: float = 0.0) -> JobStatus:
        url, options = protocol.status_call(job_id, wait, self._http.timeout)
        return protocol.parse_job((await self._request("GET", url, **options)).json())

    async def _one(self, texts: list[str], long_text: str | None, thresholds: float | Mapping[str, float] | None,
                   timeout: float | None, priority: str) -> BatchOutcome:
        if not texts:
            return BatchOutcome(texts, [])
        try:
            job = await self.submit(texts, long_text=long_text, thresholds=thresholds, priority=priority)
            return BatchOutcome(texts, (await job.wait(timeout)).results)
        except (InvalidRequest, JobFailed) as exc:
            return BatchOutcome(texts, None, exc)

    async def score_batches(self, batches: Iterable[Sequence[str]], *, long_text: str | None = None,
                            thresholds: float | Mapping[str, float] | None = None,
                            in_flight: int = protocol.DEFAULT_IN_FLIGHT,
                            timeout: float | None = None, priority: str = protocol.BULK) -> AsyncIterator[BatchOutcome]:
        """Score batches with up to `in_flight` jobs running concurrently; yields outcomes in order."""
        window: deque[asyncio.Task[BatchOutcome]] = deque()
        pending = iter(batches)
        try:
            while True:
                while len(window) < max(1, in_flight) and (batch := next(pending, None)) is not None:
                    one = self._one(list(batch), long_text, thresholds, timeout, priority)
                    window.append(asyncio.ensure_future(one))
                if not window:
                    return
                yield await window.popleft()
        finally:
            for task in window:
                task.cancel()

    async def score(self, texts: Sequence[str], *, long_text: str | None = None,
                    thresholds: float | Mapping[str, float] | None = None, job_size: int = protocol.DEFAULT_JOB_SIZE,
                    in_flight: int = protocol.DEFAULT_IN_FLIGHT, timeout: float | None = None,
                    priority: str = protocol.BULK) -> list[Result]:
        """Score any number of texts; see `Client.score`."""
        out: list[Result] = []
        batches = protocol.split(texts, job_size)
        async for outcome in self.score_batches(batches, long_text=long_text, thresholds=thresholds,
                                                in_flight=in_flight, timeout=timeout, priority=priority):
            if outcome.error is not None:
                raise outcome.error
            out += outcome.results or []
        return out
