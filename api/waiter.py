"""Wake long-polls when their results land: one Redis pub/sub connection per API process.

Celery's Redis backend publishes every stored result on a channel named after the result key. A
pub/sub connection per waiting request would tie up one Redis connection per client (100 clients
long-polling would exhaust the pool); here one listener task reads a single connection
and hands each message to the requests waiting on that key.

The connection holds one permanent pattern subscription to every result channel, confirmed by Redis
before the first waiter reads any state. A waiter then only registers its keys in this process and
reads the current state, so a result stored in between is seen by one or the other, with no Redis
command per long-poll (a SUBSCRIBE/UNSUBSCRIBE pair and a confirmation per poll cost more than the
messages of results nobody here waits for, which are dropped on arrival). After a reconnect (results
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

logger = logging.getLogger(__name__)

RESYNC = None
"""Put on a waiter's queue after a reconnect: messages may have been missed, read the state again."""

Queue = asyncio.Queue[tuple[bytes, bytes] | None]


def channel_pattern(prefix: bytes) -> bytes:
    """A PSUBSCRIBE pattern matching every channel that starts with `prefix` (glob characters escaped)."""
    escaped = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix)
    return escaped + b"*"


class ResultWaiter:
    """One pattern subscription to all result channels; `watching(keys)` yields a queue of (key, value)."""

    def __init__(self, redis: aioredis.Redis, timeout: float, result_prefix: bytes) -> None:
        self._redis = redis
        self._timeout = timeout
        self._pattern = channel_pattern(result_prefix)
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Future[None] | None = None
        self._queues: dict[bytes, set[Queue]] = {}

    async def _start(self) -> None:
        if self._listener is None or self._listener.done():
            # No await between the check and the assignments: concurrent first requests share one listener.
            self._subscribed = asyncio.get_running_loop().create_future()
            self._pubsub = self._redis.pubsub()
            self._listener = asyncio.create_task(self._listen(), name="toxfleet-result-waiter")
        assert self._subscribed is not None
        if not self._subscribed.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._subscribed), self._timeout)
            except TimeoutError as exc:
                raise RedisError("no subscription confirmation from Redis") from exc

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._listener
        if self._pubsub is not None:
            with contextlib.suppress(RedisError):
                await self._pubsub.aclose()

    async def _listen(self) -> None:
        sent = broken = False
        while True:
            try:
                if not sent:
                    await self._pubsub.psubscribe(self._pattern)
                    sent = True
                elif broken:
                    await self._pubsub.connect()  # re-subscribes the pattern (redis-py on_connect)
                if broken:
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
            if message["type"] == "pmessage":
                for queue in self._queues.get(message["channel"], ()):
                    queue.put_nowait((message["channel"], message["data"]))
            elif message["type"] == "psubscribe" and self._subscribed is not None and not self._subscribed.done():
                self._subscribed.set_result(None)

    def _wake_all(self) -> None:
        for queues in self._queues.values():
            for queue in queues:
                queue.put_nowait(RESYNC)

    @contextlib.asynccontextmanager
    async def watching(self, keys: Iterable[bytes]) -> AsyncIterator[Queue]:
        """Deliver the results published on `keys` for the duration of the block (the subscription is
        confirmed by Redis on return)."""
        await self._start()
        keys = list(dict.fromkeys(keys))
        queue: Queue = asyncio.Queue()
        for key in keys:
            self._queues.setdefault(key, set()).add(queue)
        try:
            yield queue
        finally:
            for key in keys:
                watchers = self._queues.get(key)
                if watchers is not None:
                    watchers.discard(queue)
                    if not watchers:
                        del self._queues[key]
