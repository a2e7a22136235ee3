"""Admission control for the API process itself: new work gets a fast 429 while its event loop lags.

The backlog check (`api.services.submit`) bounds the work waiting for the workers. It cannot see work
waiting for the API: when one API process is the bottleneck (a model so fast that the workers keep up,
or a burst), requests queue in front of its event loop without bound, and every answer, a refusal
included, comes as late as that queue is long (the tiny checkpoint at twice its capacity: 429s after
24.7 s at p99).

`LoopLag` tells how long the loop has stayed behind. `Admission` (pure ASGI, before routing and body
parsing) refuses new work while that is over the limit. A refusal costs a small fraction of an accepted job, so
the loop drains and its lag stays near the limit instead of growing. Only the routes that bring new
work are guarded: polls of accepted jobs, deletes and health checks always pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Collection, Iterable

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import PROBLEM_TYPE, ApiBusy, problem_bytes

LAG_INTERVAL = 0.05
"""Seconds the monitor sleeps between readings. Its cost is one wake-up per interval; a lag shorter than
the interval is still seen, as the lateness of the next wake-up."""

LAG_WINDOW = 0.25
"""Seconds a lag must last to count: the lag is the least lateness of the wake-ups of this window. One slow
iteration (a batch of results waking many long-polls at once: up to 0.11 s at 100 closed-loop clients on
the tiny checkpoint) is not saturation; a loop that stays behind, or stalls for longer, is."""


class LoopLag:
    """How far behind this event loop is, from a task that sleeps `interval` at a time and records how
    late each wake-up comes.

    `seconds()` is the smallest lateness among the wake-ups of the last `window` seconds, the pending one
    included once it is overdue: one slow iteration among on-time ones reads as on time, while a loop
    that stays behind, or stalls for longer than the window (the overdue wake-up is then the only
    reading left), reads as behind at once, without waiting for the monitor's own turn."""

    def __init__(self, interval: float = LAG_INTERVAL, window: float = LAG_WINDOW) -> None:
        self.interval = interval
        self.window = window
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._due = math.inf
        self._readings: deque[tuple[float, float]] = deque()  # (when, how late), the last `window` seconds

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="toxfleet-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._due = math.inf
        self._readings.clear()

    def seconds(self) -> float:
        """How many seconds the loop has stayed behind (0 before `start`)."""
        if self._loop is None:
            return 0.0
        now = self._loop.time()
        overdue = now - self._due
        lag = overdue if overdue > 0 else math.inf
        for at, late in self._readings:
            if at >= now - self.window:
                lag = min(lag, late)
        return 0.0 if lag == math.inf else lag

    async def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            self._due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            self._readings.append((now, max(0.0, now - self._due)))
            while self._readings[0][0] < now - self.window:
                self._readings.popleft()


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
        body = problem_bytes(ApiBusy.status_code, ApiBusy.problem, ApiBusy.title,
                             f"this API process is {lag:.2f} s behind its requests (limit {self.max_lag:g} s); "
                             "retry later")
        await send({"type": "http.response.start", "status": ApiBusy.status_code,
                    "headers": [(b"content-type", PROBLEM_TYPE.encode()),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(ApiBusy.retry_after).encode())]})
        await send({"type": "http.response.body", "body": body})


def install(app: Starlette, lag: LoopLag, max_lag: float, guarded: frozenset[tuple[str, str]]) -> None:
    """Adds `Admission` to a Starlette/FastAPI app; `max_lag` 0 adds nothing."""
    if max_lag > 0:
        app.add_middleware(Admission, lag=lag, max_lag=max_lag, guarded=guarded)
