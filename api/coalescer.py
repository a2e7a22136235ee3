"""Do the I/O of concurrent requests together: a group forms while the previous group's I/O runs.

There is no timer: on an idle API a request's I/O starts at once, alone, in the request's own task; on
a busy one every request that arrives while a group is in flight waits for it and then goes in the
next group, as the workers batch requests (`worker.batching`). What a group shares is the fixed cost
of one round trip, a thread hop, a connection taken from the pool, the event-loop wake-ups: for a
small model, most of what a Redis write or a kombu send costs the API per request.

`Coalescer(run)` takes `run(items) -> results`, list in and list out; `pipelined(redis)` is one
whose items queue commands on a shared Redis pipeline, each getting its own replies back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")
R = TypeVar("R")

Queue = Callable[[Any], None]
"""Queues one request's commands on a pipeline (`pipe.set(...)`, ...); it must not await."""


class Coalescer(Generic[T, R]):
    """`await coalescer(item)` runs `item` in the next group and returns its own result, or raises
    what its group's `run` raised (every item of a failed group gets that error).

    A request that finds nothing in flight runs its item at once, in its own task (no task to start,
    no future to wake: an idle API pays nothing for this); requests arriving meanwhile wait, and one
    background task runs their groups, one after the other, until none waits."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._busy = False  # a group is in flight (the inline one or the background task's)
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._runner: asyncio.Task[None] | None = None
        self.groups = 0
        """Groups run so far (each one round trip), for tests and benchmarks."""

    async def __call__(self, item: T) -> R:
        if self._busy:
            done: asyncio.Future[R] = asyncio.get_running_loop().create_future()
            self._waiting.append((item, done))
            return await done
        self._busy = True
        try:
            results = await self._run_group([item])
        finally:
            self._hand_over()
        return results[0]

    async def _run_group(self, items: list[T]) -> list[R]:
        self.groups += 1
        results = await self._run(items)
        if len(results) != len(items):
            raise RuntimeError(f"{len(results)} results for {len(items)} items")
        return results

    def _hand_over(self) -> None:
        """After the inline group: the requests that arrived meanwhile go next, in the background task
        (none runs yet: it runs only while `_busy`, and the inline group held that)."""
        if self._waiting:
            self._runner = asyncio.create_task(self._run_waiting(), name="toxfleet-coalescer")
        else:
            self._busy = False

    async def _run_waiting(self) -> None:
        group: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                try:
                    results = await self._run_group([item for item, _ in group])
                except Exception as exc:
                    for _, done in group:
                        _settle(done, error=exc)
                else:
                    for (_, done), result in zip(group, results, strict=True):
                        _settle(done, result)
                group = []
        finally:
            self._runner = None
            self._busy = False
            # Cancelled mid-run (the API stopping): no request is left waiting for good.
            for _, done in group + self._waiting:
                _settle(done, error=RuntimeError("stopped before this request's I/O ran"))
            self._waiting = []


def _settle(done: asyncio.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    if done.done():  # its request was cancelled meanwhile (the client went away)
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)


def pipelined(redis: aioredis.Redis, transaction: bool) -> Coalescer[Queue, list[Any]]:
    """Requests' Redis commands in one pipeline per group (with `transaction`, one MULTI/EXEC: a
    group's commands all apply or none do); each request gets the replies of its own commands."""

    async def run(queues: list[Queue]) -> list[list[Any]]:
        async with redis.pipeline(transaction=transaction) as pipe:
            spans = []
            for queue in queues:
                start = len(pipe)
                queue(pipe)
                spans.append((start, len(pipe)))
            replies = await pipe.execute()
        return [replies[start:end] for start, end in spans]

    return Coalescer(run)
