"""The HTTP conversation both clients hold, as pure decisions: what to send, how to read an answer,
whether and when to retry. The blocking and asyncio clients differ only in how they wait."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

import toxfleet.client.results as answers
from toxfleet.chunking import split as _split

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

BULK = "bulk"
"""The priority `score`/`score_batches` (and so `toxfleet score`) send: backfills must not delay
interactive traffic. `submit` sends none: the server's default, interactive."""

DEFAULT_IN_FLIGHT = 8
"""Jobs `score` keeps submitted at once, so the fleet always has the next one queued."""

DEFAULT_STALL_AFTER = 600.0
"""Seconds a waited job may make no progress, while the fleet reports ready workers, before it is
submitted again (its messages went with the broker); a job that keeps progressing is never resubmitted."""

logger = logging.getLogger("toxfleet.client")

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_BACKOFF_START, _BACKOFF_CAP = 0.5, 10.0



def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not sent by toxfleet; fall back to backoff


def error_of(response: httpx.Response) -> answers.APIError:
    """The exception for an error answer: an RFC 9457 problem (`type`, `detail`, a 422's `errors`),
    or whatever body a proxy in front sent."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    kind = {401: answers.Unauthorized, 404: answers.JobNotFound, 400: answers.InvalidRequest,
            413: answers.InvalidRequest, 422: answers.InvalidRequest}.get(response.status_code, answers.APIError)
    errors = body.get("errors")
    return kind(response.status_code, body.get("detail", response.text), retry_after(response),
                problem_type=body.get("type"), errors=errors if isinstance(errors, list) else None)


def backoff_delay(attempt: int, response: httpx.Response | None) -> float:
    """Seconds before retry `attempt` (0-based): the server's Retry-After, else jittered exponential backoff."""
    if response is not None and (after := retry_after(response)) is not None:
        return after + random.uniform(0.0, 0.1 * max(after, 1.0))
    backoff: float = min(_BACKOFF_CAP, _BACKOFF_START * 2.0 ** attempt)
    return random.uniform(0.5, 1.0) * backoff


def parse_job(body: Mapping[str, Any]) -> answers.JobStatus:
    results = None
    if body.get("results") is not None:
        flags = body.get("flags") or [None] * len(body["results"])
        results = [answers.Result(dict(scores), f["flagged"] if f else None, dict(f["labels"]) if f else None)
                   for scores, f in zip(body["results"], flags, strict=True)]
    progress = body.get("progress") or {}
    return answers.JobStatus(id=body["id"], status=body["status"], done=int(progress.get("done", 0)),
                     total=int(progress.get("total", 0)), results=results, model=body.get("model"),
                     error=body.get("error"), cache_hits=int(body.get("cache_hits") or 0),
                     created_at=body.get("created_at"), started_at=body.get("started_at"),
                     finished_at=body.get("finished_at"), expires_at=body.get("expires_at"))


def submit_body(texts: Sequence[str], long_text: str | None,
                thresholds: float | Mapping[str, float] | None, priority: str | None = None) -> dict[str, Any]:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    body: dict[str, Any] = {"texts": list(texts)}
    if long_text is not None:
        body["long_text"] = long_text
    if priority is not None:
        body["priority"] = priority
    if thresholds is not None:
        body["thresholds"] = thresholds if isinstance(thresholds, int | float) else dict(thresholds)
    return body


def split(texts: Sequence[str], job_size: int = DEFAULT_JOB_SIZE,
          job_chars: int = DEFAULT_JOB_CHARS) -> list[list[str]]:
    """Consecutive batches of at most `job_size` texts and about `job_chars` characters (a longer
    text still gets a batch of its own)."""
    return list(_split(texts, len, job_chars, job_size))


def remaining(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


def problem_of(response: httpx.Response) -> Exception | None:
    """None for a success, the error to retry after for a retryable status; raises any other error."""
    if response.status_code < 400:
        return None
    if response.status_code not in _RETRY_STATUSES:
        raise error_of(response)
    return error_of(response)


def retry_delay(attempt: int, response: httpx.Response | None, problem: Exception | None, deadline: float,
                 what: str, retry_for: float) -> float:
    """Seconds before the next try, or Unavailable when waiting them would pass the retry deadline."""
    delay = backoff_delay(attempt, response)
    if time.monotonic() + delay > deadline:
        raise answers.Unavailable(f"{what}: gave up after {retry_for:g}s: {problem}") from problem
    return delay


def status_call(job_id: str, wait: float, timeout: httpx.Timeout) -> tuple[str, dict[str, Any]]:
    """URL and request options of a job read that may hold for `wait` seconds (the read timeout grows by it)."""
    params = {"wait": f"{wait:.3f}"} if wait > 0 else None
    return f"/v1/jobs/{job_id}", {"params": params, "timeout": httpx.Timeout(
        timeout.connect, read=(timeout.read or DEFAULT_TIMEOUT) + wait)}


def settled(status: answers.JobStatus, deadline: float | None, timeout: float | None) -> bool:
    """True once the job succeeded; JobFailed, or JobTimeout past the deadline; else False."""
    if status.status == "failed":
        raise answers.JobFailed(status)
    if status.finished:
        return True
    if remaining(deadline) <= 0:
        raise answers.JobTimeout(status, timeout or 0.0)
    return False


def early_pause(started: float, hold: float, attempt: int, deadline: float | None) -> float | None:
    """Seconds to back off when the server answered well before `hold` without a result (it caps the
    wait), else None."""
    if time.monotonic() - started >= hold / 2:
        return None
    return min(backoff_delay(attempt, None), max(0.0, remaining(deadline)))



@dataclass
class Submission:
    """What a job was submitted with, so that a job the broker lost can be submitted again: the same
    body under the same Idempotency-Key (a twin resubmit from elsewhere joins it). A server that still
    maps the key to the very job that vanished or stalled gets a key derived from it (`generation`)."""

    body: dict[str, Any]
    key: str
    generation: int = 0

    def headers(self) -> dict[str, str]:
        return {"Idempotency-Key": self.key if self.generation == 0 else f"{self.key}.{self.generation}"}

    def answered(self, lost_id: str, new_id: str, why: str) -> bool:
        """Note the server's answer to a resubmit of `lost_id`; False when it returned that same job
        (then ask again under the next derived key)."""
        if new_id == lost_id:
            self.generation += 1
            return False
        logger.warning("job %s %s; submitted again as job %s", lost_id, why, new_id)
        return True


class Progress:
    """When a waited job last moved (its status or count of finished chunks changed), to tell a job
    that is slow from one that is stuck."""

    def __init__(self, stall_after: float | None) -> None:
        self.stall_after = stall_after
        self.reset()

    def reset(self) -> None:
        self._seen: tuple[str, str, int] | None = None
        self._since = time.monotonic()

    def stalled(self, status: answers.JobStatus) -> bool:
        mark = (status.id, status.status, status.done)
        if mark != self._seen:
            self._seen, self._since = mark, time.monotonic()
        return self.stall_after is not None and time.monotonic() - self._since >= self.stall_after


def fleet_ready(response: httpx.Response) -> bool:
    """Whether `/readyz` says the broker answers and workers are beating: only then is a job that
    makes no progress stuck rather than waiting for a fleet that is away."""
    try:
        body = response.json()
        return response.status_code == 200 and body.get("status") == "ready" and int(body.get("workers", 0)) > 0
    except (ValueError, AttributeError, TypeError):
        return False


def default_headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": "toxfleet-client"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers

