"""The fleet as the API sees it: the workers that answer (from their heartbeats) and the backlog."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import redis.asyncio as aioredis

from fleet.cache import AsyncScoreCache
from fleet.keys import Heartbeat
from fleet.queue import Backlog, alive_workers, aread_backlog
from toxfleet import contract

FLEET_TTL = 2.0
"""Seconds the API reuses its view of the live workers: their processes scale the backpressure limit,
and their model, backend and cache setting decide whether the score cache may answer a job."""

BACKLOG_TTL = 0.05
"""Seconds submits share one backlog read (one round trip) for the backpressure check: under load many
submits arrive within this window, and each would otherwise read the same counters. The messages this
process sent since the read are added to it (`count_sent`), so its own submits are counted exactly;
other API processes' submits of the last window, and work finished in it, are not seen until the next
read: the limit may be passed, or reached early, by what a fleet submits or finishes in 50 ms."""


T = TypeVar("T")


class _SharedRead(Generic[T]):
    """One Redis read shared by every caller for `ttl` seconds. Callers that arrive while it is in
    flight await it rather than start their own: under load a whole burst of submits asks at once, and
    a view that expired would otherwise be read once per submit of the burst. A failed read is not reused."""

    def __init__(self, ttl: float, read: Callable[[], Awaitable[T]]) -> None:
        self._ttl = ttl
        self._read = read
        self._future: asyncio.Future[T] | None = None
        self._at = -ttl

    def due(self) -> bool:
        """Whether the next `get` starts a read: none yet, the last older than `ttl`, or it failed."""
        f = self._future
        return (f is None or time.monotonic() >= self._at + self._ttl
                or (f.done() and (f.cancelled() or f.exception() is not None)))

    async def get(self) -> T:
        if self.due():
            self._at = time.monotonic()
            # A task, not a coroutine: a caller that is cancelled must not cancel the read the others await.
            self._future = asyncio.ensure_future(self._read())
        assert self._future is not None
        return await asyncio.shield(self._future)


class FleetService:
    """Workers, backlog and cache size. One per process."""

    def __init__(self, redis: aioredis.Redis, cache: AsyncScoreCache | None = None) -> None:
        self._redis = redis
        self._cache = cache
        self._workers = _SharedRead(FLEET_TTL, self.workers)
        self._backlog = _SharedRead(BACKLOG_TTL, self.backlog)
        self._sent_since_read = 0

    async def workers(self) -> list[Heartbeat]:
        """Workers whose heartbeat is recent, with what they run."""
        return await alive_workers(self._redis)

    async def recent_workers(self) -> list[Heartbeat]:
        """`workers()`, read at most once per FLEET_TTL seconds (submits ask on every job); concurrent
        callers share one read."""
        return await self._workers.get()

    async def backlog(self) -> Backlog:
        """Messages waiting, messages delivered but unacknowledged, and answering workers (one round trip)."""
        return await aread_backlog(self._redis)

    async def recent_backlog(self) -> Backlog:
        """`backlog()`, read at most once per BACKLOG_TTL seconds, plus the messages sent here since;
        concurrent callers share one read, and a failed read is not reused."""
        if self._backlog.due():
            # Sends during the read may be counted twice (in it and here): an overestimate, on the safe side.
            self._sent_since_read = 0
        backlog = await self._backlog.get()
        return dataclasses.replace(backlog, queued=backlog.queued + self._sent_since_read)

    def count_sent(self, messages: int) -> None:
        """`messages` were just sent: `recent_backlog` counts them until its next read."""
        self._sent_since_read += messages

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
