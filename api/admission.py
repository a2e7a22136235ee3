"""Admission control for the API process itself: new work gets a fast 429 while its event loop lags.

The backlog check (`api.services.submit`) bounds the work waiting for the workers. It cannot see work
waiting for the API: when one API process is the bottleneck (a model so fast that the workers keep up,
or a burst), requests queue in front of its event loop without bound, and every answer, a refusal
included, comes as late as that queue is long (measured: docs/history.md).

`LoopLag` tells how far behind the loop stays. `Admission` (pure ASGI, before routing and body
parsing) refuses new work while that is over the limit. A refusal costs a small fraction of an accepted job, so
the loop drains and its lag stays near the limit instead of growing. Only the routes that bring new
work are guarded: polls of accepted jobs, deletes and health checks always pass.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Collection, Iterable

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiBusy, send_problem

LAG_INTERVAL = 0.05
"""Seconds the monitor sleeps between readings. Its cost is one wake-up per interval; a lag shorter than
the interval is still seen, as the lateness of the next wake-up."""

LAG_READINGS = 2
"""Wake-ups that must all come late for the loop to count as behind: the lag is the least lateness of
the last LAG_READINGS. A single slow stretch, however long (a burst of results waking many long-polls at
once, a garbage collection, a first request's lazy set-up), makes one late wake-up: the requests that
arrive after it find an idle loop and must not be refused. A saturated loop makes every wake-up late."""


class LoopLag:
    """How far behind this event loop is, from a task that sleeps `interval` at a time and records how
    late each wake-up comes: `seconds()` is the least lateness of the last `readings` wake-ups."""

    def __init__(self, interval: float = LAG_INTERVAL, readings: int = LAG_READINGS) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._late: deque[float] = deque([0.0] * readings, maxlen=readings)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="toxfleet-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._late.extend([0.0] * len(self._late))

    def seconds(self) -> float:
        """How many seconds the loop is behind (0 before `start`)."""
        return min(self._late)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self._late.append(max(0.0, loop.time() - due))


def guarded_paths(routes: Iterable[BaseRoute], endpoints: Collection[object]) -> frozenset[tuple[str, str]]:
    """(method, path) of each route served by one of `endpoints`; they must have no path parameters,
    so that `Admission` can match a request by its raw path before routing."""
    paths: set[tuple[str, str]] = set()
    found: set[object] = set()
    for route in routes:
        if isinstance(route, Route) and route.endpoint in endpoints:
            if route.param_convertors:
                raise ValueError(f"{route.path}: a guarded route cannot take path parameters")
            paths.update((method, route.path) for method in route.methods or ())
            found.add(route.endpoint)
    if len(found) < len(endpoints):
        raise ValueError(f"no route serves {[e for e in endpoints if e not in found]}")
    return frozenset(paths)


class Admission:
    """Answers 429 `api-busy` to new work while the loop lags more than `max_lag` seconds."""

    def __init__(self, app: ASGIApp, lag: LoopLag, max_lag: float, guarded: frozenset[tuple[str, str]]) -> None:
        self.app = app
        self.lag = lag
        self.max_lag = max_lag
        self.guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self.guarded:
            lag = self.lag.seconds()
            if lag > self.max_lag:
                await self._refuse(send, lag)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, lag: float) -> None:
        await send_problem(send, ApiBusy.status_code, ApiBusy.problem, ApiBusy.title,
                           f"this API process is {lag:.2f} s behind its requests (limit {self.max_lag:g} s); "
                           "retry later", [(b"retry-after", str(ApiBusy.retry_after).encode())])


def install(app: Starlette, lag: LoopLag, max_lag: float, guarded: frozenset[tuple[str, str]]) -> None:
    """Adds `Admission` to a Starlette/FastAPI app; `max_lag` 0 adds nothing."""
    if max_lag > 0:
        app.add_middleware(Admission, lag=lag, max_lag=max_lag, guarded=guarded)
