"""The fleet's backlog, read in one round trip: what the API's backpressure, its `/metrics` and the
autoscaling signal (`tools.backlog`) all look at, so they can never disagree on what is waiting."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from fleet.keys import HEARTBEAT_STALE_SECONDS, UNACKED_KEY, WORKERS_KEY, Heartbeat, worker_info_key
from toxfleet.contract import QUEUES


@dataclass(frozen=True)
class Backlog:
    """Task messages not yet finished, and the workers that share them."""

    queued: int
    """Messages waiting in the queues (both lanes)."""
    unacked: int
    """Messages delivered to a worker and not yet acknowledged (late acks: buffered or being scored)."""
    workers: int
    """Workers whose heartbeat is recent."""

    @property
    def total(self) -> int:
        return self.queued + self.unacked

    @property
    def per_task(self) -> float:
        # With no worker alive the whole backlog is one task's: scale-out still sees it.
        return self.total / max(self.workers, 1)


def _stage(pipe: Any, now: float) -> None:
    for queue in QUEUES:
        pipe.llen(queue)
    pipe.hlen(UNACKED_KEY)
    pipe.zcount(WORKERS_KEY, now - HEARTBEAT_STALE_SECONDS, "+inf")


def read_backlog(client: redis.Redis, now: float | None = None) -> Backlog:
    with client.pipeline(transaction=False) as pipe:
        _stage(pipe, time.time() if now is None else now)
        *queued, unacked, workers = pipe.execute()
    return Backlog(sum(map(int, queued)), int(unacked), int(workers))


async def aread_backlog(client: aioredis.Redis, now: float | None = None) -> Backlog:
    """`read_backlog` on an asyncio client."""
    async with client.pipeline(transaction=False) as pipe:
        _stage(pipe, time.time() if now is None else now)
        *queued, unacked, workers = await pipe.execute()
    return Backlog(sum(map(int, queued)), int(unacked), int(workers))


def _info_keys(names: list[Any]) -> list[str]:
    return [worker_info_key(n.decode()) for n in names if isinstance(n, bytes)]


async def alive_workers(client: aioredis.Redis, now: float | None = None) -> list[Heartbeat]:
    """The heartbeats of the workers that beat recently."""
    now = time.time() if now is None else now
    names = await client.zrangebyscore(WORKERS_KEY, now - HEARTBEAT_STALE_SECONDS, "+inf")
    infos = await client.mget(_info_keys(names)) if names else []
    return [Heartbeat.decode(i) for i in infos if i is not None]


def read_alive_workers(client: redis.Redis, now: float | None = None) -> list[Heartbeat]:
    """`alive_workers` on a blocking client."""
    now = time.time() if now is None else now
    names: Any = client.zrangebyscore(WORKERS_KEY, now - HEARTBEAT_STALE_SECONDS, "+inf")
    infos: Any = client.mget(_info_keys(names)) if names else []
    return [Heartbeat.decode(i) for i in infos if i is not None]
