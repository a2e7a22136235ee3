"""What the client returns (`Result`, `JobStatus`, `BatchOutcome`) and raises (`ToxfleetError` and below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toxfleet.contract import FINISHED_STATES, JobState


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
    """A job as the server reports it (the API's `Job`, with `progress` as `done`/`total` and each
    text's flags in its `Result`). `results` is set once `status` is "succeeded"; the times are RFC 3339
    (UTC), None until known."""

    id: str
    status: JobState
    done: int
    total: int
    results: list[Result] | None
    model: str | None
    error: str | None
    cache_hits: int = 0
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    expires_at: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATES


class ToxfleetError(Exception):
    """Base of every error this client raises."""


class APIError(ToxfleetError):
    """The server answered with an error status: `problem_type` is the RFC 9457 `type` (e.g.
    `/problems/queue-full`), `detail` the human explanation, `errors` a 422's field errors."""

    def __init__(self, status_code: int, detail: Any, retry_after: float | None = None,
                 problem_type: str | None = None, errors: list[Any] | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.retry_after = retry_after
        self.problem_type = problem_type
        self.errors = errors


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
