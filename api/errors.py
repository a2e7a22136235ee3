"""The API's errors and their one mapping to HTTP, as RFC 9457 problem details.

Every error answers `application/problem+json`: `{"type", "title", "status", "detail"}`, where
`type` is a stable relative URI per problem (`/problems/<name>`: clients branch on it, never on the
wording of `detail`); a 422 also lists its field errors in `errors` (`loc`, `msg`, `type` each).

    ApiError                          type (under /problems/)
    ├── Unauthorized          401     unauthorized         API keys are on and none (or a wrong one) was sent
    ├── JobNotFound           404     not-found            unknown, expired or deleted job, or another key's
    ├── IdempotencyMismatch   422     idempotency-mismatch an Idempotency-Key reused with a different body
    ├── QueueFull             429     queue-full           more waiting work than the backlog limit; retry later
    ├── RateLimited           429     rate-limited         the caller's key is over `rate_limit` requests per second
    ├── ApiBusy               429     api-busy             this API process lags over `max_loop_lag` (api.admission)
    ├── BrokerUnavailable     503     broker-unavailable   Redis did not answer in time; retry later
    ├── NotReplicated         503     not-replicated       fewer replicas than `submit_min_replicas` hold the job
    ├── ScoringFailed         502     scoring-failed       a drop-in endpoint's job failed in the workers
    └── ScoringTimeout        504     scoring-timeout      a drop-in endpoint got no result in `compat_timeout`
    request validation        422     validation           a field is missing, mistyped or over a limit
    body over the limit       413     body-too-large       (api.bodylimit, before the body is read)
    no such route / method    404/405 not-found / method-not-allowed
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route
from starlette.types import Send

PROBLEM_TYPE = "application/problem+json"
PROBLEM_PREFIX = "/problems/"


def problem(status: int, name: str, title: str, detail: str, **extra: Any) -> dict[str, Any]:
    """An RFC 9457 problem document."""
    return {"type": PROBLEM_PREFIX + name, "title": title, "status": status, "detail": detail, **extra}


def problem_bytes(status: int, name: str, title: str, detail: str) -> bytes:
    return json.dumps(problem(status, name, title, detail)).encode()


async def send_problem(send: Send, status: int, name: str, title: str, detail: str,
                       headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer a problem straight through ASGI `send`, for middleware that refuses before routing."""
    body = problem_bytes(status, name, title, detail)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", PROBLEM_TYPE.encode()), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def problem_response(status: int, name: str, title: str, detail: str, headers: dict[str, str] | None = None,
                     **extra: Any) -> JSONResponse:
    return JSONResponse(problem(status, name, title, detail, **extra), status_code=status, headers=headers,
                        media_type=PROBLEM_TYPE)


class ApiError(Exception):
    status_code = 500
    problem = "internal"
    title = "Internal error"
    retry_after: int | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(ApiError):
    status_code, problem, title = 401, "unauthorized", "Missing or invalid API key"


class JobNotFound(ApiError):
    status_code, problem, title = 404, "not-found", "No such job"


class IdempotencyMismatch(ApiError):
    status_code, problem, title = 422, "idempotency-mismatch", "Idempotency-Key reused with a different request"


class QueueFull(ApiError):
    status_code, problem, title = 429, "queue-full", "Queue full"
    retry_after = 5


class RateLimited(ApiError):
    status_code, problem, title = 429, "rate-limited", "Rate limit exceeded"
    retry_after = 1


class ApiBusy(ApiError):
    """Raised by no handler: api.admission answers it before routing, from these attributes."""

    status_code, problem, title = 429, "api-busy", "API busy"
    retry_after = 1


class BrokerUnavailable(ApiError):
    status_code, problem, title = 503, "broker-unavailable", "Broker unavailable"
    retry_after = 2


class NotReplicated(ApiError):
    status_code, problem, title = 503, "not-replicated", "Not replicated"
    retry_after = 1


class ScoringFailed(ApiError):
    status_code, problem, title = 502, "scoring-failed", "Scoring failed"


class ScoringTimeout(ApiError):
    status_code, problem, title = 504, "scoring-timeout", "Scoring timed out"


BODY_TOO_LARGE = (413, "body-too-large", "Request body too large")
"""(status, problem, title) of a body over `max_body_bytes` (answered by api.bodylimit)."""

_HTTP_PROBLEMS = {404: ("not-found", "Not found"), 405: ("method-not-allowed", "Method not allowed")}


def field_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Each error's location, message and kind; never its `input` (a scored text, echoed back)."""
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in errors]


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return problem_response(exc.status_code, exc.problem, exc.title, exc.detail, headers)


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = field_errors(exc.errors())
    detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
    return problem_response(422, "validation", "Request validation failed", detail, errors=errors)


def index_methods(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """Record which methods each route path serves, for the `Allow` header of a 405. Starlette's 405
    names only the methods of the first route whose path matched, and a path that several routes
    serve (a job's GET and DELETE, each its own route) would advertise only one of them."""
    app.state.route_methods = [(r.path_regex, frozenset(r.methods or ())) for r in routes if isinstance(r, Route)]


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this request's path, as `Allow` lists them."""
    table = getattr(request.app.state, "route_methods", [])
    path = request.scope.get("path", "")
    return ", ".join(sorted({m for regex, methods in table if regex.match(path) for m in methods}))


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    name, title = _HTTP_PROBLEMS.get(exc.status_code, ("http-error", "HTTP error"))
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request) or headers.get("Allow", "")
    elif exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
        # FastAPI's "error parsing the body": JSON that is not UTF-8. Invalid JSON is a 422 validation
        # problem (FastAPI's own JSON decode error), and so is this.
        msg = f"not UTF-8 JSON ({exc.__cause__.__class__.__name__})"
        return problem_response(422, "validation", "Request validation failed", f"body: {msg}",
                                errors=[{"loc": ["body"], "msg": msg, "type": "json_invalid"}])
    return problem_response(exc.status_code, name, title, str(exc.detail), headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
