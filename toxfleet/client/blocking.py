"""The blocking client: `Client` and its `Job` handles."""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import httpx

import toxfleet.client.protocol as protocol
from toxfleet.client.results import (
    BatchOutcome,
    InvalidRequest,
    JobFailed,
    JobNotFound,
    JobStatus,
    Result,
    ToxfleetError,
)


class Job:
    """A submitted job: `wait()` for it, or `status()` for where it is now. A job this client
    submitted is submitted again by `wait()` if the broker loses it (`id` then changes)."""

    def __init__(self, client: Client, job_id: str, submission: protocol.Submission | None = None) -> None:
        self.client = client
        self.id = job_id
        self.submission = submission
        self.resubmitted = 0

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobStatus:
        return self.client.job_status(self.id)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Long-poll until the job finishes; the succeeded status, JobFailed, or JobTimeout after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        progress = protocol.Progress(self.client.stall_after)
        while True:
            hold = max(0.0, min(self.client.poll_wait, protocol.remaining(deadline)))
            started = time.monotonic()
            try:
                status = self.client.job_status(self.id, wait=hold)
            except JobNotFound:
                if self.submission is None:
                    raise
                # Accepted, then unknown: the broker lost it (a Redis restarted empty, a failover).
                self._resubmit("is unknown to the server (lost with the broker)")
                progress.reset()
                continue
            if protocol.settled(status, deadline, timeout):
                return status
            if self.submission is not None and progress.stalled(status) and self.client.fleet_ready():
                self._resubmit(f"made no progress for {self.client.stall_after:g}s while the fleet was ready")
                progress.reset()
                continue
            if (pause := protocol.early_pause(started, hold, attempt, deadline)) is not None:
                time.sleep(pause)
                attempt += 1

    def _resubmit(self, why: str) -> None:
        assert self.submission is not None
        while not self.submission.answered(self.id, new := self.client._send(self.submission), why):
            pass
        self.id = new
        self.resubmitted += 1


class Client:
    """Blocking client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = protocol.DEFAULT_TIMEOUT,
                 poll_wait: float = protocol.DEFAULT_POLL_WAIT, retry_for: float = protocol.DEFAULT_RETRY_FOR,
                 stall_after: float | None = protocol.DEFAULT_STALL_AFTER,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = protocol.default_headers(api_key)
        self.poll_wait = poll_wait
        self.retry_for = retry_for
        self.stall_after = stall_after
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
                problem = protocol.problem_of(response)
                if problem is None:
                    return response
            except httpx.TransportError as exc:
                problem = exc
            time.sleep(protocol.retry_delay(attempt, response, problem, deadline, f"{method} {url}",
                                            self.retry_for))
            attempt += 1

    def submit(self, texts: Sequence[str], *, long_text: str | None = None,
               thresholds: float | Mapping[str, float] | None = None, priority: str | None = None) -> Job:
        """Enqueue texts for scoring (at most the server's `max_texts`); returns at once.
        `long_text`: "truncate" (default) or "windows"; `thresholds`: one probability, or {label: p}."""
        submission = protocol.Submission(protocol.submit_body(texts, long_text, thresholds, priority), uuid.uuid4().hex)
        return Job(self, self._send(submission), submission)

    def _send(self, submission: protocol.Submission) -> str:
        response = self._request("POST", "/v1/jobs", json=submission.body, headers=submission.headers())
        job_id: str = response.json()["id"]
        return job_id

    def fleet_ready(self) -> bool:
        """Whether the broker answers and workers are beating (`/readyz`), asked once without retries."""
        try:
            return protocol.fleet_ready(self._http.get("/readyz"))
        except httpx.HTTPError:
            return False

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (by this or another process)."""
        return Job(self, job_id)

    def job_status(self, job_id: str, wait: float = 0.0) -> JobStatus:
        url, options = protocol.status_call(job_id, wait, self._http.timeout)
        return protocol.parse_job(self._request("GET", url, **options).json())

    def score_batches(self, batches: Iterable[Sequence[str]], *, long_text: str | None = None,
                      thresholds: float | Mapping[str, float] | None = None,
                      in_flight: int = protocol.DEFAULT_IN_FLIGHT,
                      timeout: float | None = None, priority: str = protocol.BULK) -> Iterator[BatchOutcome]:
        """Score batches (one job each) with up to `in_flight` jobs submitted at once; yields one
        outcome per batch, in order, as soon as it and all before it are done. A batch whose job fails
        or is refused yields its error; the others go on. Sent as `bulk` work unless `priority` says
        "interactive"."""
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
                    submitted = self.submit(texts, long_text=long_text, thresholds=thresholds,
                                            priority=priority) if texts else None
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
              thresholds: float | Mapping[str, float] | None = None, job_size: int = protocol.DEFAULT_JOB_SIZE,
              in_flight: int = protocol.DEFAULT_IN_FLIGHT, timeout: float | None = None,
              priority: str = protocol.BULK) -> list[Result]:
        """Score any number of texts: split into jobs, several in flight, results in input order,
        as `bulk` work unless `priority` says "interactive".
        Raises the first failure (JobFailed, InvalidRequest, ...)."""
        out: list[Result] = []
        batches = protocol.split(texts, job_size)
        for outcome in self.score_batches(batches, long_text=long_text, thresholds=thresholds,
                                          in_flight=in_flight, timeout=timeout, priority=priority):
            if outcome.error is not None:
                raise outcome.error
            out += outcome.results or []
        return out
