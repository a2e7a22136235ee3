"""Load generators: a closed loop of C clients, and an open loop at a fixed arrival rate.

Both talk HTTP on loopback only, through one of three *modes*:

- `baseline`: the existing service, `GET /toxicity?q=`.
- `compat`: toxfleet's drop-in `GET /toxicity?q=` (same request, same response shape).
- `jobs`: toxfleet's own API, `POST /v1/jobs {"texts": [q]}` then `GET /v1/jobs/{id}?wait=...`
  (long-poll) until the job has succeeded or failed; the latency is submit to final answer.

Every request becomes one `Sample` (issue time, end time, outcome). Outcomes are kept apart: `ok`,
`error` (a non-2xx other than 429, a failed job, a malformed answer, a broken connection),
`refused` (429: the service said it is full), `timeout` (no answer within the deadline) and
`dropped` (open loop only: the generator's own in-flight cap was reached, nothing was sent).

The closed loop counts what *completed* inside each measurement window (a steady state has no
edge effects worth more); the open loop counts what was *issued* inside each window and then waits
for it, up to the deadline, so a queue that grows without bound shows as growing latency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from bench.stats import percentile

MODES = ("baseline", "compat", "jobs")

OK, ERROR, REFUSED, TIMEOUT, DROPPED = "ok", "error", "refused", "timeout", "dropped"
OUTCOMES = (OK, ERROR, REFUSED, TIMEOUT, DROPPED)

DEFAULT_DEADLINE = 120.0
"""Seconds a request may take before it counts as a timeout (the baseline's p99 at 100 clients is ~30 s)."""

LONG_POLL_SECONDS = 30.0
"""`?wait=` of each job poll: the API's default maximum, so one poll usually returns the answer."""

DEFAULT_MAX_WARMUP = 90.0
"""Closed loop: longest warm-up before the windows start anyway."""

FAILURE_PAUSE = 0.1
"""Closed loop: seconds a client waits after a failed or refused request before its next one, as a
real client would back off; without it a fast-failing service would be hammered by a spinning loop."""

DEFAULT_MAX_IN_FLIGHT = 2000
"""Open loop: requests outstanding at once before new arrivals are dropped by the generator itself."""

def raise_open_files_limit(need: int = 2 * DEFAULT_MAX_IN_FLIGHT + 256) -> None:
    """Raise this process's soft limit on open files to `need` (at most the hard limit). Called before
    the servers start, so they inherit it: the open loop holds up to `DEFAULT_MAX_IN_FLIGHT` connections,
    the API as many, and a user's shell often starts at 1024 (the bench then died of EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


P = TypeVar("P")


@dataclass(frozen=True)
class Sample:
    """One request: when it was issued and ended (seconds since the load started), how it ended, and
    `index`, the position of its text in the corpus (-1: unknown)."""

    start: float
    end: float
    outcome: str
    status: int | None = None
    index: int = -1

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class LoadRun:
    """Everything one load run recorded; `boundaries` are window edges, `probes` what was sampled there,
    `outstanding` how many requests were awaiting an answer at each edge."""

    samples: list[Sample]
    boundaries: list[float]
    probes: list[Any]
    outstanding: list[int] = field(default_factory=list)


class Caller:
    """Sends one text in a given mode and says how it ended."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, mode: str,
                 deadline: float = DEFAULT_DEADLINE) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.mode = mode
        self.deadline = deadline
        #: Why requests failed: "<status> <detail>" -> count (the service's own words, for diagnosis).
        self.failures: Counter[str] = Counter()

    async def __call__(self, text: str) -> tuple[str, int | None]:
        try:
            async with asyncio.timeout(self.deadline):
                if self.mode == "jobs":
                    return await self._job(text)
                return await self._get(text)
        except TimeoutError:
            return TIMEOUT, None
        except (aiohttp.ClientError, ValueError, KeyError) as exc:
            self.failures[f"{exc.__class__.__name__}: {exc}"[:160]] += 1
            return ERROR, None

    def _failed(self, status: int, body: bytes) -> tuple[str, int]:
        try:
            detail = str(json.loads(body).get("detail", ""))
        except (ValueError, AttributeError):
            detail = body[:100].decode(errors="replace")
        self.failures[f"{status} {detail}"[:160]] += 1
        return ERROR, status

    async def _get(self, text: str) -> tuple[str, int | None]:
        async with self.session.get(f"{self.base_url}/toxicity", params={"q": text}) as resp:
            body = await resp.read()
            if resp.status == 429:
                return REFUSED, resp.status
            if resp.status != 200:
                return self._failed(resp.status, body)
            scores = _json(body)
            ok = isinstance(scores, dict) and bool(scores)
            return (OK if ok else ERROR), resp.status

    async def _job(self, text: str) -> tuple[str, int | None]:
        async with self.session.post(f"{self.base_url}/v1/jobs", json={"texts": [text]}) as resp:
            body = await resp.read()
            if resp.status == 429:
                return REFUSED, resp.status
            if resp.status != 202:
                return self._failed(resp.status, body)
            location = resp.headers.get("Location") or _json(body)["url"]
        started = time.monotonic()
        while True:
            wait = max(0.0, min(LONG_POLL_SECONDS, self.deadline - (time.monotonic() - started)))
            async with self.session.get(f"{self.base_url}{location}", params={"wait": f"{wait:.1f}"}) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return self._failed(resp.status, body)
                job = _json(body)
            if job["status"] == "succeeded":
                ok = isinstance(job.get("results"), list) and len(job["results"]) == 1
                return (OK if ok else ERROR), resp.status
            if job["status"] == "failed":
                return self._failed(resp.status, json.dumps({"detail": f"job failed: {job.get('error')}"}).encode())


def _json(body: bytes) -> Any:
    return json.loads(body)


def session(connections: int) -> aiohttp.ClientSession:
    """A keep-alive client session allowing `connections` concurrent connections (loopback only)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def _probe_at(t0: float, boundaries: Sequence[float], probe: Callable[[], P], out: list[P]) -> None:
    for b in boundaries:
        await asyncio.sleep(max(0.0, t0 + b - time.monotonic()))
        out.append(probe())


async def closed_loop(call: Callable[[str], Awaitable[tuple[str, int | None]]], texts: Sequence[str], clients: int,
                      warmup: float, windows: int, window: float, probe: Callable[[], P],
                      ramp: float = 1.0, max_warmup: float = DEFAULT_MAX_WARMUP) -> LoadRun:
    """`clients` clients, each sending the next text as soon as its previous answer arrived.

    Clients start spread over `ramp` seconds (so they do not move in lockstep). The warm-up lasts at
    least `warmup` seconds and until as many answers as clients have arrived (every queue in the
    system has filled), at most `max_warmup`; its samples belong to no window. A window is stretched
    to the warm-up's median latency when that is longer, so that a window sees a full turn of every
    client. `probe()` is called at every window edge.
    """
    if clients < 1 or windows < 1 or window <= 0 or not texts:
        raise ValueError("need clients >= 1, windows >= 1, window > 0 and some texts")
    counter = itertools.count()
    samples: list[Sample] = []
    t0 = time.monotonic()

    async def client(i: int) -> None:
        await asyncio.sleep(ramp * i / clients)
        while True:
            index = next(counter) % len(texts)
            start = time.monotonic() - t0
            outcome, status = await call(texts[index])
            samples.append(Sample(start, time.monotonic() - t0, outcome, status, index))
            if outcome != OK:
                await asyncio.sleep(FAILURE_PAUSE)

    probes: list[P] = []
    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    try:
        while True:
            now = time.monotonic() - t0
            if now >= max_warmup or (now >= warmup and len(samples) >= clients):
                break
            await asyncio.sleep(0.05)
        if samples:
            window = max(window, percentile([s.latency for s in samples], 50))
        boundaries = [now + k * window for k in range(windows + 1)]
        await _probe_at(t0, boundaries, probe, probes)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return LoadRun(samples, boundaries, probes)


async def open_loop(call: Callable[[str], Awaitable[tuple[str, int | None]]], texts: Sequence[str], rate: float,
                    warmup: float, windows: int, window: float, probe: Callable[[], P], seed: int = 0,
                    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> LoadRun:
    """Poisson arrivals at `rate` per second, whatever the answers; then waits for every request
    (each ends by its own deadline). Arrivals beyond `max_in_flight` outstanding are `dropped`."""
    if rate <= 0 or windows < 1 or window <= 0 or not texts:
        raise ValueError("need rate > 0, windows >= 1, window > 0 and some texts")
    rng = random.Random(seed)
    samples: list[Sample] = []
    in_flight: set[asyncio.Task[None]] = set()
    end = warmup + windows * window
    boundaries = [warmup + k * window for k in range(windows + 1)]
    probes: list[P] = []
    t0 = time.monotonic()

    async def one(index: int, start: float) -> None:
        outcome, status = await call(texts[index])
        samples.append(Sample(start, time.monotonic() - t0, outcome, status, index))

    outstanding: list[int] = []

    def probe_and_count() -> P:
        outstanding.append(len(in_flight))
        return probe()

    prober = asyncio.create_task(_probe_at(t0, boundaries, probe_and_count, probes))
    arrival = 0.0
    for i in itertools.count():
        arrival += rng.expovariate(rate)
        if arrival >= end:
            break
        await asyncio.sleep(max(0.0, t0 + arrival - time.monotonic()))
        if len(in_flight) >= max_in_flight:
            samples.append(Sample(arrival, arrival, DROPPED, None, i % len(texts)))
            continue
        task = asyncio.create_task(one(i % len(texts), arrival))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await prober
    if in_flight:
        await asyncio.gather(*in_flight, return_exceptions=True)
    return LoadRun(samples, boundaries, probes, outstanding)


def in_window(run: LoadRun, k: int, by: str) -> list[Sample]:
    """Samples of window `k`: by `end` (closed loop: completed in it) or by `start` (open loop: issued in it)."""
    lo, hi = run.boundaries[k], run.boundaries[k + 1]
    if by == "end":
        return [s for s in run.samples if lo <= s.end < hi]
    if by == "start":
        return [s for s in run.samples if lo <= s.start < hi]
    raise ValueError("by must be 'start' or 'end'")
