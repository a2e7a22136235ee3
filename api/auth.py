"""Optional API keys (`Authorization: Bearer <key>`) and a per-key rate limit.

Keys are off until `TOXFLEET_API_KEYS` is set; then every job and scoring route needs one, while
health endpoints and the docs stay open. The limit is a fixed one-second window per key, counted in
Redis so that every API process shares it. Keys are never stored or logged: only a short hash.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import RedisError

from api.errors import BrokerUnavailable, RateLimited, Unauthorized
from api.settings import ApiSettings
from toxfleet.keys import rate_key


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
"""Declares the bearer scheme in OpenAPI (the /docs Authorize button); the check itself is ours."""


async def check_key(request: Request, settings: ApiSettings, redis: aioredis.Redis,
                    credentials: HTTPAuthorizationCredentials | None) -> str | None:
    """The caller's key id (its owner name for jobs and idempotency keys) when keys are configured;
    401 without a valid key, 429 over the limit."""
    keys = settings.api_key_list
    if not keys:
        return None
    token = credentials.credentials if credentials else ""
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
