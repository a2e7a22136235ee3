"""Optional API keys (`Authorization: Bearer <key>`) and a per-key rate limit.

Keys are off until `TOXFLEET_API_KEYS` is set; then every job and scoring route needs one, while
health endpoints and the docs stay open. The limit is a fixed one-second window per key, counted in
Redis so that every API process shares it. Keys are never stored or logged: only a short hash.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.security import HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from redis.exceptions import RedisError

from api.errors import BrokerUnavailable, RateLimited, Unauthorized
from api.settings import ApiSettings
from fleet.keys import rate_key


def key_id(key: str) -> str:
    """A short, non-reversible name for a key, for counters and logs."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


async def count_request(redis: aioredis.Redis, window: str) -> int:
    """Count a request in a rate-limit window key (expires with the window)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(window)
        pipe.expire(window, 2)
        count, _ = await pipe.execute()
    return int(count)


bearer = HTTPBearer(auto_error=False, description="An API key from `TOXFLEET_API_KEYS` (when it is set).")
"""The bearer scheme as OpenAPI declares it (the /docs Authorize button), never called per request:
as a sub-dependency FastAPI would solve it on every request, a cost paid by every job."""


def document_bearer(app: FastAPI, operations: set[tuple[str, str]]) -> None:
    """Declare `bearer` on these (path, method) operations of the app's OpenAPI, as FastAPI would have
    had each taken it as a dependency."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()  # FastAPI keeps it as app.openapi_schema, so this runs once
        spec.setdefault("components", {}).setdefault("securitySchemes", {})[bearer.scheme_name] = \
            bearer.model.model_dump(mode="json", by_alias=True, exclude_none=True)
        for path, method in operations:
            spec["paths"][path][method]["security"] = [{bearer.scheme_name: []}]
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def bearer_token(request: Request) -> str:
    """The request's `Authorization: Bearer` credentials, "" without them (what `bearer` would read)."""
    scheme, credentials = get_authorization_scheme_param(request.headers.get("authorization"))
    return credentials if scheme.lower() == "bearer" else ""


async def check_key(request: Request, settings: ApiSettings, redis: aioredis.Redis) -> str | None:
    """The caller's key id (its owner name for jobs and idempotency keys) when keys are configured;
    401 without a valid key, 429 over the limit."""
    keys = settings.api_key_list
    if not keys:
        return None
    token = bearer_token(request)
    if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    ident = key_id(token)
    if settings.rate_limit:
        try:
            count = await count_request(redis, rate_key(ident, int(time.time())))
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if count > settings.rate_limit:
            raise RateLimited(f"rate limit of {settings.rate_limit} requests per second exceeded for this key")
    request.state.key_id = ident
    return ident
