"""The benchmark's load generator against a real local HTTP server whose answers the test controls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bench import load

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(routes: list[tuple[str, str, Handler]]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def toxicity(request: web.Request) -> web.Response:
    q = request.query["q"]
    if q == "full":
        return web.json_response({"detail": "queue is full"}, status=429)
    if q == "broken":
        return web.json_response({"detail": "broker unavailable: MaxConnectionsError"}, status=503)
    if q == "slow":
        await asyncio.sleep(1.5)
    if q == "empty":
        return web.json_response({})
    await asyncio.sleep(0.01)
    return web.json_response({"toxicity": 0.5})


def jobs_routes() -> list[tuple[str, str, Handler]]:
    polls: dict[str, int] = {}

    async def submit(request: web.Request) -> web.Response:
        texts = (await request.json())["texts"]
        job = f"{len(polls):032x}"
        polls[job] = 0
        if texts == ["full"]:
            return web.json_response({"detail": "full"}, status=429)
        if texts == ["fails"]:
            polls[job] = -100
        return web.json_response({"id": job, "url": f"/v1/jobs/{job}"}, status=202,
                                 headers={"Location": f"/v1/jobs/{job}"})

    async def get(request: web.Request) -> web.Response:
        job = request.match_info["job"]
        assert float(request.query["wait"]) > 0, "the generator long-polls"
        polls[job] += 1
        if polls[job] < 0:
            return web.json_response({"id": job, "status": "failed", "results": None, "error": "boom"})
        if polls[job] < 2:  # first poll: still running, as a long-poll that ran out of time
            return web.json_response({"id": job, "status": "running", "results": None})
        return web.json_response({"id": job, "status": "succeeded", "results": [{"toxicity": 0.1}]})

    return [("POST", "/v1/jobs", submit), ("GET", "/v1/jobs/{job}", get)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_outcomes_are_classified() -> None:
    """200 with scores is ok; 429 is refused; other statuses, empty answers and failed jobs are errors;
    a request past its deadline is a timeout."""

    async def go() -> tuple[list[tuple[str, int | None]], Any]:
        runner, url = await serve([("GET", "/toxicity", toxicity), *jobs_routes()])
        try:
            async with load.session(8) as s:
                get = load.Caller(s, url, "baseline", deadline=0.5)
                jobs = load.Caller(s, url, "jobs", deadline=5.0)
                out = [await get("hello"), await get("full"), await get("broken"), await get("empty"),
                       await get("slow"), await jobs("hello"), await jobs("full"), await jobs("fails")]
                return out, get.failures + jobs.failures
        finally:
            await runner.cleanup()

    outcomes, failures = run(go())
    assert [o for o, _ in outcomes] == [load.OK, load.REFUSED, load.ERROR, load.ERROR, load.TIMEOUT,
                                        load.OK, load.REFUSED, load.ERROR]
    assert failures["503 broker unavailable: MaxConnectionsError"] == 1
    assert failures["200 job failed: boom"] == 1


def test_closed_loop_counts_completions_inside_windows() -> None:
    """Each window counts only requests completed in it, the warm-up none, and probes mark every edge."""

    async def go() -> load.LoadRun:
        runner, url = await serve([("GET", "/toxicity", toxicity)])
        try:
            async with load.session(8) as s:
                ticks = iter(range(100))
                return await load.closed_loop(load.Caller(s, url, "compat"), ["a", "b"], clients=4, warmup=0.3,
                                              windows=3, window=0.3, probe=lambda: next(ticks), ramp=0.1)
        finally:
            await runner.cleanup()

    result = run(go())
    assert result.probes == [0, 1, 2, 3]
    assert len(result.boundaries) == 4 and result.boundaries[0] >= 0.3
    per_window = [load.in_window(result, k, "end") for k in range(3)]
    assert all(len(w) > 10 for w in per_window)  # 4 clients x ~10 ms each for 0.3 s
    inside = sum(len(w) for w in per_window)
    warmup = [s for s in result.samples if s.end < result.boundaries[0]]
    assert warmup and inside + len(warmup) <= len(result.samples)
    assert all(s.outcome == load.OK for s in result.samples)


def test_closed_loop_window_stretches_to_the_warmup_latency() -> None:
    """When answers take longer than a window, each window lasts at least the warm-up's median latency."""

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(0.4)
        return web.json_response({"toxicity": 0.5})

    async def go() -> load.LoadRun:
        runner, url = await serve([("GET", "/toxicity", slow)])
        try:
            async with load.session(4) as s:
                return await load.closed_loop(load.Caller(s, url, "baseline"), ["a"], clients=2, warmup=0.0,
                                              windows=1, window=0.1, probe=lambda: None, ramp=0.0)
        finally:
            await runner.cleanup()

    result = run(go())
    assert result.boundaries[1] - result.boundaries[0] >= 0.4


def test_open_loop_sends_at_the_given_rate_whatever_the_answers() -> None:
    """Arrivals follow the seeded Poisson schedule; over the in-flight cap they are dropped, not sent."""

    async def go(cap: int) -> load.LoadRun:
        runner, url = await serve([("GET", "/toxicity", toxicity)])
        try:
            async with load.session(64) as s:
                return await load.open_loop(load.Caller(s, url, "baseline", deadline=1.2), ["slow"], rate=40,
                                            warmup=0.0, windows=2, window=0.5, probe=lambda: None, seed=7,
                                            max_in_flight=cap)
        finally:
            await runner.cleanup()

    capped = run(go(5))
    outcomes = [s.outcome for s in capped.samples]
    assert 20 <= len(outcomes) <= 60  # 40/s for 1 s
    assert outcomes.count(load.TIMEOUT) == 5  # "slow" takes 1.5 s > the 1.2 s deadline, longer than the run
    assert outcomes.count(load.DROPPED) == len(outcomes) - 5
    assert len(capped.outstanding) == 3 and max(capped.outstanding) <= 5
    issued = sum(len(load.in_window(capped, k, "start")) for k in range(2))
    assert issued == len(outcomes)
    again = run(go(5))
    assert [s.start for s in again.samples if s.outcome == load.DROPPED] == \
        [s.start for s in capped.samples if s.outcome == load.DROPPED]  # same seed, same arrivals


def test_closed_loop_backs_off_after_failures() -> None:
    """A client pauses after a failed request, so a service failing fast is not hammered by the generator."""

    async def go() -> load.LoadRun:
        runner, url = await serve([("GET", "/toxicity", toxicity)])
        try:
            async with load.session(4) as s:
                return await load.closed_loop(load.Caller(s, url, "baseline"), ["broken"], clients=2, warmup=0.0,
                                              windows=1, window=0.5, probe=lambda: None, ramp=0.0)
        finally:
            await runner.cleanup()

    result = run(go())
    assert all(s.outcome == load.ERROR for s in result.samples)
    assert 2 <= len(result.samples) <= 2 * (0.5 / load.FAILURE_PAUSE + 2)
