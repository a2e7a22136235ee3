"""The API's errors and their one mapping to HTTP.

    ApiError
    ├── Unauthorized       401  API keys are on and none (or a wrong one) was sent
    ├── JobNotFound        404  unknown (or expired) job id
    ├── IdempotencyMismatch 422 an Idempotency-Key reused with a different body
    ├── QueueFull          429  more waiting work than the backlog limit; retry later
    ├── RateLimited        429  the caller's key is over `rate_limit` requests per second
    ├── BrokerUnavailable  503  Redis did not answer in time; retry later
    ├── ScoringFailed      502  a drop-in endpoint's job failed in the workers
    └── ScoringTimeout     504  a drop-in endpoint's result did not arrive in `compat_timeout`
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class ApiError(Exception):
    status_code = 500
    retry_after: int | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(ApiError):
    status_code = 401


class JobNotFound(ApiError):
    status_code = 404


class IdempotencyMismatch(ApiError):
    status_code = 422


class QueueFull(ApiError):
    status_code = 429
    retry_after = 5


class RateLimited(ApiError):
    status_code = 429
    retry_after = 1


class BrokerUnavailable(ApiError):
    status_code = 503
    retry_after = 2


class ScoringFailed(ApiError):
    status_code = 502


class ScoringTimeout(ApiError):
    status_code = 504


async def _handle(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _handle)
