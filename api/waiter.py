"""Wake long-polls when their results land: one Redis pub/sub connection per API process.

Celery's Redis backend publishes every stored result on a channel named after the result key. A
pub/sub connection per waiting request would tie up one Redis connection per client (100 clients
long-polling exhausted the pool in the benchmark); here one listener task reads a single connection
and hands each message to the requests waiting on that key.

A waiter subscribes, waits for Redis to *confirm* the subscription, and only then reads the current
state, so a result stored in between is seen by one or the other. After a reconnect (results
published meanwhile are gone) every waiter is woken to read the state again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from toxfleet.keys import WAITER_CHANNEL

logger = logging.getLogger(__name__)

RESYNC = None
"""Put on a waiter's queue after a reconnect: messages may have been missed, read the state again."""

Queue = asyncio.Queue[tuple[bytes, bytes] | None]


class ResultWaiter:
    """Shared subscriptions to result channels; `watching(keys)` yields a queue of (key, value)."""

    def __init__(self, redis: aioredis.Redis, timeout: float) -> None:
        self._redis = redis
        self._timeout = timeout
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._queues: dict[bytes, set[Queue]] = {}
        self._confirmed: set[bytes] = set()
        self._confirming: dict[bytes, list[asyncio.Future[None]]] = {}

    async def _start(self) -> None:
        if self._listener is None or self._listener.done():
            self._pubsub = self._redis.pubsub()
            await self._pubsub.subscribe(WAITER_CHANNEL)
            self._listener = asyncio.create_task(self._listen(), name="toxfleet-result-waiter")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._listener
        if self._pubsub is not None:
            with contextlib.suppress(RedisError):
                await self._pubsub.aclose()

    async def _listen(self) -> None:
        broken = False
        while True:
            try:
                if broken:
                    await self._pubsub.connect()  # re-subscribes every channel (redis-py on_connect)
                    broken = False
                    self._wake_all()
                message = await self._pubsub.get_message(timeout=1.0)
            except (RedisError, OSError) as exc:
                if not broken:
                    logger.warning("result listener lost Redis (%r); reconnecting", exc)
                broken = True
                self._wake_all()
                await asyncio.sleep(0.5)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if message["type"] == "subscribe":
                self._confirmed.add(channel)
                for future in self._confirming.pop(channel, []):
                    if not future.done():
                        future.set_result(None)
            elif message["type"] == "message":
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait((channel, message["data"]))

    def _wake_all(self) -> None:
        for queues in self._queues.values():
            for queue in queues:
                queue.put_nowait(RESYNC)

    @contextlib.asynccontextmanager
    async def watching(self, keys: Iterable[bytes]) -> AsyncIterator[Queue]:
        """Subscribe to `keys` (confirmed by Redis on return) for the duration of the block."""
        await self._start()
        keys = list(dict.fromkeys(keys))
        queue: Queue = asyncio.Queue()
        new: list[bytes] = []
        for key in keys:
            waiting = self._queues.setdefault(key, set())
            if not waiting:
                new.append(key)
            waiting.add(queue)
        try:
            # Every key not yet confirmed, including one another request is subscribing right now.
            loop = asyncio.get_running_loop()
            futures = []
            for key in keys:
                if key not in self._confirmed:
                    future: asyncio.Future[None] = loop.create_future()
                    self._confirming.setdefault(key, []).append(future)
                    futures.append(future)
            if new:
                await self._pubsub.subscribe(*new)
            if futures:
                try:
                    await asyncio.wait_for(asyncio.gather(*futures), self._timeout)
                except TimeoutError as exc:
                    raise RedisError("no subscription confirmation from Redis") from exc
            yield queue
        finally:
            gone = []
            for key in keys:
                watchers = self._queues.get(key)
                if watchers is not None:
                    watchers.discard(queue)
                    if not watchers:
                        del self._queues[key]
                        self._confirmed.discard(key)
                        self._confirming.pop(key, None)
                        gone.append(key)
            if gone and self._pubsub is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.unsubscribe(*gone)
