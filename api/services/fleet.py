"""The fleet as the API sees it: the workers that answer (from their heartbeats) and the backlog."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from toxfleet import contract
from toxfleet.cache import AsyncScoreCache
from toxfleet.keys import Heartbeat
from toxfleet.queue import Backlog, alive_workers, aread_backlog

FLEET_TTL = 2.0
"""Seconds the API reuses its view of the live workers: their processes scale the backpressure limit,
and their model, backend and cache setting decide whether the score cache may answer a job."""


class FleetService:
    """Workers, backlog and cache size. One per process."""

    def __init__(self, redis: aioredis.Redis, cache: AsyncScoreCache | None = None) -> None:
        self._redis = redis
        self._cache = cache
        self._view: list[Heartbeat] = []
        self._view_at = -FLEET_TTL

    async def workers(self) -> list[Heartbeat]:
        """Workers whose heartbeat is recent, with what they run."""
        return await alive_workers(self._redis)

    async def recent_workers(self) -> list[Heartbeat]:
        """`workers()`, re-read at most every FLEET_TTL seconds: submits ask on every job."""
        now = time.monotonic()
        if now >= self._view_at + FLEET_TTL:
            self._view = await self.workers()
            self._view_at = now
        return self._view

    async def backlog(self) -> Backlog:
        """Messages waiting, messages delivered but unacknowledged, and answering workers (one round trip)."""
        return await aread_backlog(self._redis)

    async def queue_depth(self) -> int:
        async with self._redis.pipeline(transaction=False) as pipe:
            for queue in contract.QUEUES:
                pipe.llen(queue)
            depths = await pipe.execute()
        return sum(int(d) for d in depths)

    async def cache_entries(self) -> int | None:
        """Entries in the score cache now (None when the cache is off here)."""
        return await self._cache.entries() if self._cache is not None else None

    async def ping(self) -> None:
        await self._redis.ping()
