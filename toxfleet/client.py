"""Python client for the toxfleet HTTP API: `Client` (blocking) and `AsyncClient` (asyncio).

    from toxfleet.client import Client

    with Client("http://localhost:8000", api_key=None) as tf:
        job = tf.submit(["you are lovely", "you are an idiot"])   # 202: queued
        status = job.wait(timeout=30)                            # long-polls until done
        for r in status.results:
            print(r.flagged, r["toxicity"], r.labels)
        results = tf.score(texts)                                # any size: split, pipelined, in order

Needs only httpx (no torch, no Celery). Submits carry an `Idempotency-Key`, so a submit retried after
a lost connection never creates a second job. `429` and `503` are retried after the `Retry-After` the
server sends (else with exponential backoff) until `retry_for` seconds are spent, then
`Unavailable` is raised. Waiting uses the server's long-poll (`?wait=`), so a finished job is seen
at once without polling in a loop.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "APIError", "AsyncClient", "AsyncJob", "BatchOutcome", "Client", "InvalidRequest", "Job", "JobFailed",
    "JobNotFound", "JobStatus", "JobTimeout", "Result", "ToxfleetError", "Unauthorized", "Unavailable",
]

DEFAULT_TIMEOUT = 10.0
"""Seconds for connecting and for a plain request (a long-poll gets its wait on top)."""

DEFAULT_POLL_WAIT = 20.0
"""Seconds one long-poll asks the server to hold (the server's `TOXFLEET_MAX_WAIT` is 30 by default)."""

DEFAULT_RETRY_FOR = 120.0
"""Seconds spent retrying one request through 429, 503 and connection errors before giving up."""

DEFAULT_JOB_SIZE = 256
"""Texts per job when `score` splits a large input (the server's default cap is 1,000)."""

DEFAULT_JOB_CHARS = 1_000_000
"""Characters per job when `score` splits a large input (keeps bodies under the server's 4 MiB limit)."""

DEFAULT_IN_FLIGHT = 8
"""Jobs `score` keeps submitted at once, so the fleet always has the next one queued."""

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_BACKOFF_START, _BACKOFF_CAP = 0.5, 10.0


# -- results and errors ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """One text's scores: `scores[label]` is a probability (also `result[label]`); `flagged` and
    `labels` (per-label booleans) apply the job's thresholds (None from a server that predates them)."""

    scores: dict[str, float]
    flagged: bool | None = None
    labels: dict[str, bool] | None = None

    def __getitem__(self, label: str) -> float:
        return self.scores[label]


@dataclass(frozen=True)
class JobStatus:
    """A job as the server reports it. `results` is set once `status` is "succeeded"."""

    id: str
    status: str  # queued | running | succeeded | failed
    done: int
    total: int
    results: list[Result] | None
    model: str | None
    error: str | None
    cache_hits: int = 0

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed")


class ToxfleetError(Exception):
    """Base of every error this client raises."""


class APIError(ToxfleetError):
    """The server answered with an error status."""

    def __init__(self, status_code: int, detail: Any, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.retry_after = retry_after


class Unauthorized(APIError):
    """401: API keys are on and the key is missing or wrong."""


class JobNotFound(APIError):
    """404: no such job (or it expired)."""


class InvalidRequest(APIError):
    """400, 413 or 422: the request itself is wrong (too many texts, a text too long, a bad threshold)."""


class Unavailable(ToxfleetError):
    """The server stayed overloaded (429), unavailable (503) or unreachable for `retry_for` seconds."""


class JobFailed(ToxfleetError):
    """The job finished as failed; `status.error` says why."""

    def __init__(self, status: JobStatus) -> None:
        super().__init__(f"job {status.id} failed: {status.error}")
        self.status = status


class JobTimeout(ToxfleetError, TimeoutError):
    """The job did not finish within the timeout; it may still finish later (`status` is the last seen)."""

    def __init__(self, status: JobStatus, timeout: float) -> None:
        super().__init__(f"job {status.id} still {status.status} after {timeout:g}s")
        self.status = status


@dataclass(frozen=True)
class BatchOutcome:
    """One batch of `score_batches`: the texts, and their results or the error that stopped them."""

    texts: list[str]
    results: list[Result] | None
    error: ToxfleetError | None = None


# -- pure helpers shared by both clients ----------------------------------------------------------


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not sent by toxfleet; fall back to backoff


def _error(response: httpx.Response) -> APIError:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    kind = {401: Unauthorized, 404: JobNotFound, 400: InvalidRequest, 413: InvalidRequest,
            422: InvalidRequest}.get(response.status_code, APIError)
    return kind(response.status_code, detail, _retry_after(response))


def _delay(attempt: int, response: httpx.Response | None) -> float:
    """Seconds before retry `attempt` (0-based): the server's Retry-After, else jittered exponential backoff."""
    if response is not None and (after := _retry_after(response)) is not None:
        return after + random.uniform(0.0, 0.1 * max(after, 1.0))
    backoff: float = min(_BACKOFF_CAP, _BACKOFF_START * 2.0 ** attempt)
    return random.uniform(0.5, 1.0) * backoff


def _parse_job(body: Mapping[str, Any]) -> JobStatus:
    results = None
    if body.get("results") is not None:
        flags = body.get("flags") or [None] * len(body["results"])
        results = [Result(dict(scores), f["flagged"] if f else None, dict(f["labels"]) if f else None)
                   for scores, f in zip(body["results"], flags, strict=True)]
    progress = body.get("progress") or {}
    return JobStatus(id=body["id"], status=body["status"], done=int(progress.get("done", 0)),
                     total=int(progress.get("total", 0)), results=results, model=body.get("model"),
                     error=body.get("error"), cache_hits=int(body.get("cache_hits") or 0))


def _submit_body(texts: Sequence[str], long_text: str | None,
                 thresholds: float | Mapping[str, float] | None) -> dict[str, Any]:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    body: dict[str, Any] = {"texts": list(texts)}
    if long_text is not None:
        body["long_text"] = long_text
    if thresholds is not None:
        body["thresholds"] = thresholds if isinstance(thresholds, int | float) else dict(thresholds)
    return body


def split(texts: Sequence[str], job_size: int = DEFAULT_JOB_SIZE,
          job_chars: int = DEFAULT_JOB_CHARS) -> list[list[str]]:
    """Consecutive batches of at most `job_size` texts and about `job_chars` characters (a longer
    text still gets a batch of its own)."""
    batches: list[list[str]] = []
    current: list[str] = []
    chars = 0
    for text in texts:
        if current and (len(current) >= job_size or chars + len(text) > job_chars):
            batches.append(current)
            current, chars = [], 0
        current.append(text)
        chars += len(text)
    if current:
        batches.append(current)
    return batches


def _remaining(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


# The blocking and asyncio clients differ only in how they wait; every decision lives here.

def _problem(response: httpx.Response) -> Exception | None:
    """None for a success, the error to retry after for a retryable status; raises any other error."""
    if response.status_code < 400:
        return None
    if response.status_code not in _RETRY_STATUSES:
        raise _error(response)
    return _error(response)


def _retry_delay(attempt: int, response: httpx.Response | None, problem: Exception | None, deadline: float,
                 what: str, retry_for: float) -> float:
    """Seconds before the next try, or Unavailable when waiting them would pass the retry deadline."""
    delay = _delay(attempt, response)
    if time.monotonic() + delay > deadline:
        raise Unavailable(f"{what}: gave up after {retry_for:g}s: {problem}") from problem
    return delay


def _status_call(job_id: str, wait: float, timeout: httpx.Timeout) -> tuple[str, dict[str, Any]]:
    """URL and request options of a job read that may hold for `wait` seconds (the read timeout grows by it)."""
    params = {"wait": f"{wait:.3f}"} if wait > 0 else None
    return f"/v1/jobs/{job_id}", {"params": params, "timeout": httpx.Timeout(
        timeout.connect, read=(timeout.read or DEFAULT_TIMEOUT) + wait)}


def _settled(status: JobStatus, deadline: float | None, timeout: float | None) -> bool:
    """True once the job succeeded; JobFailed, or JobTimeout past the deadline; else False."""
    if status.status == "failed":
        raise JobFailed(status)
    if status.finished:
        return True
    if _remaining(deadline) <= 0:
        raise JobTimeout(status, timeout or 0.0)
    return False


def _early_pause(started: float, hold: float, attempt: int, deadline: float | None) -> float | None:
    """Seconds to back off when the server answered well before `hold` without a result (it caps the
    wait), else None."""
    if time.monotonic() - started >= hold / 2:
        return None
    return min(_delay(attempt, None), max(0.0, _remaining(deadline)))


# -- blocking client ------------------------------------------------------------------------------


class Job:
    """A submitted job: `wait()` for it, or `status()` for where it is now."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobStatus:
        return self.client.job_status(self.id)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Long-poll until the job finishes; the succeeded status, JobFailed, or JobTimeout after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            hold = max(0.0, min(self.client.poll_wait, _remaining(deadline)))
            started = time.monotonic()
            status = self.client.job_status(self.id, wait=hold)
            if _settled(status, deadline, timeout):
                return status
            if (pause := _early_pause(started, hold, attempt, deadline)) is not None:
                time.sleep(pause)
                attempt += 1


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": "toxfleet-client"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


class Client:
    """Blocking client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 poll_wait: float = DEFAULT_POLL_WAIT, retry_for: float = DEFAULT_RETRY_FOR,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = _headers(api_key)
        self.poll_wait = poll_wait
        self.retry_for = retry_for
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                  transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_for
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = self._http.request(method, url, **kwargs)
                problem = _problem(response)
                if problem is None:
                    return response
            except httpx.TransportError as exc:
                problem = exc
            time.sleep(_retry_delay(attempt, response, problem, deadline, f"{method} {url}", self.retry_for))
            attempt += 1

    def submit(self, texts: Sequence[str], *, long_text: str | None = None,
               thresholds: float | Mapping[str, float] | None = None) -> Job:
        """Enqueue texts for scoring (at most the server's `max_texts`); returns at once.
        `long_text`: "truncate" (default) or "windows"; `thresholds`: one probability, or {label: p}."""
        body = _submit_body(texts, long_text, thresholds)
        response = self._request("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
        return Job(self, response.json()["id"])

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (by this or another process)."""
        return Job(self, job_id)

    def job_status(self, job_id: str, wait: float = 0.0) -> JobStatus:
        url, options = _status_call(job_id, wait, self._http.timeout)
        return _parse_job(self._request("GET", url, **options).json())

    def score_batches(self, batches: Iterable[Sequence[str]], *, long_text: str | None = None,
                      thresholds: float | Mapping[str, float] | None = None, in_flight: int = DEFAULT_IN_FLIGHT,
                      timeout: float | None = None) -> Iterator[BatchOutcome]:
        """Score batches (one job each) with up to `in_flight` jobs submitted at once; yields one
        outcome per batch, in order, as soon as it and all before it are done. A batch whose job fails
        or is refused yields its error; the others go on."""
        window: deque[tuple[list[str], Job | ToxfleetError | None]] = deque()
        pending = iter(batches)
        exhausted = False
        while True:
            while not exhausted and len(window) < max(1, in_flight):
                batch = next(pending, None)
                if batch is None:
                    exhausted = True
                    break
                texts = list(batch)
                try:
                    submitted = self.submit(texts, long_text=long_text, thresholds=thresholds) if texts else None
                    window.append((texts, submitted))
                except InvalidRequest as exc:
                    window.append((texts, exc))
            if not window:
                return
            texts, job = window.popleft()
            if job is None:
                yield BatchOutcome(texts, [])
            elif isinstance(job, ToxfleetError):
                yield BatchOutcome(texts, None, job)
            else:
                try:
                    yield BatchOutcome(texts, job.wait(timeout).results)
                except JobFailed as exc:
                    yield BatchOutcome(texts, None, exc)

    def score(self, texts: Sequence[str], *, long_text: str | None = None,
              thresholds: float | Mapping[str, float] | None = None, job_size: int = DEFAULT_JOB_SIZE,
              in_flight: int = DEFAULT_IN_FLIGHT, timeout: float | None = None) -> list[Result]:
        """Score any number of texts: split into jobs, several in flight, results in input order.
        Raises the first failure (JobFailed, InvalidRequest, ...)."""
        out: list[Result] = []
        for outcome in self.score_batches(split(texts, job_size), long_text=long_text, thresholds=thresholds,
                                          in_flight=in_flight, timeout=timeout):
            if outcome.error is not None:
                raise outcome.error
            out += outcome.results or []
        return out


# -- asyncio client -------------------------------------------------------------------------------


class AsyncJob:
    """A submitted job: `await wait()` for it, or `await status()` for where it is now."""

    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self) -> JobStatus:
        return await self.client.job_status(self.id)

    async def wait(self, timeout: float | None = None) -> JobStatus:
        """Long-poll until the job finishes; the succeeded status, JobFailed, or JobTimeout after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            hold = max(0.0, min(self.client.poll_wait, _remaining(deadline)))
            started = time.monotonic()
            status = await self.client.job_status(self.id, wait=hold)
            if _settled(status, deadline, timeout):
                return status
            if (pause := _early_pause(started, hold, attempt, deadline)) is not None:
                await asyncio.sleep(pause)
                attempt += 1


class AsyncClient:
    """asyncio client, same methods as `Client` as coroutines. Use `async with`, or `await aclose()`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 poll_wait: float = DEFAULT_POLL_WAIT, retry_for: float = DEFAULT_RETRY_FOR,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = _headers(api_key)
        self.poll_wait = poll_wait
        self.retry_for = retry_for
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
                problem = _problem(response)
                if problem is None:
                    return response
            except httpx.TransportError as exc:
                problem = exc
            await asyncio.sleep(_retry_delay(attempt, response, problem, deadline, f"{method} {url}", self.retry_for))
            attempt += 1

    async def submit(self, texts: Sequence[str], *, long_text: str | None = None,
                     thresholds: float | Mapping[str, float] | None = None) -> AsyncJob:
        """Enqueue texts for scoring; see `Client.submit`."""
        body = _submit_body(texts, long_text, thresholds)
        response = await self._request("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
        return AsyncJob(self, response.json()["id"])

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def job_status(self, job_id: str, wait: float = 0.0) -> JobStatus:
        url, options = _status_call(job_id, wait, self._http.timeout)
        return _parse_job((await self._request("GET", url, **options)).json())

    async def _one(self, texts: list[str], long_text: str | None, thresholds: float | Mapping[str, float] | None,
                   timeout: float | None) -> BatchOutcome:
        if not texts:
            return BatchOutcome(texts, [])
        try:
            job = await self.submit(texts, long_text=long_text, thresholds=thresholds)
            return BatchOutcome(texts, (await job.wait(timeout)).results)
        except (InvalidRequest, JobFailed) as exc:
            return BatchOutcome(texts, None, exc)

    async def score_batches(self, batches: Iterable[Sequence[str]], *, long_text: str | None = None,
                            thresholds: float | Mapping[str, float] | None = None,
                            in_flight: int = DEFAULT_IN_FLIGHT,
                            timeout: float | None = None) -> AsyncIterator[BatchOutcome]:
        """Score batches with up to `in_flight` jobs running concurrently; yields outcomes in order."""
        window: deque[asyncio.Task[BatchOutcome]] = deque()
        pending = iter(batches)
        try:
            while True:
                while len(window) < max(1, in_flight) and (batch := next(pending, None)) is not None:
                    window.append(asyncio.ensure_future(self._one(list(batch), long_text, thresholds, timeout)))
                if not window:
                    return
                yield await window.popleft()
        finally:
            for task in window:
                task.cancel()

    async def score(self, texts: Sequence[str], *, long_text: str | None = None,
                    thresholds: float | Mapping[str, float] | None = None, job_size: int = DEFAULT_JOB_SIZE,
                    in_flight: int = DEFAULT_IN_FLIGHT, timeout: float | None = None) -> list[Result]:
        """Score any number of texts; see `Client.score`."""
        out: list[Result] = []
        async for outcome in self.score_batches(split(texts, job_size), long_text=long_text, thresholds=thresholds,
                                                in_flight=in_flight, timeout=timeout):
            if outcome.error is not None:
                raise outcome.error
            out += outcome.results or []
        return out
