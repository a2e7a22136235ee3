"""How the API process tells that its event loop lags (`api.admission.LoopLag`, on a real asyncio loop),
and which routes its admission check guards."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import APIRouter

from api import admission
from api.main import NEW_WORK
from api.routes import compat, health, jobs


def test_one_stall_however_long_is_not_a_lag() -> None:
    """A single slow stretch makes one late wake-up: what arrives after it finds an idle loop."""
    async def go() -> tuple[float, float, float]:
        lag = admission.LoopLag(interval=0.02)
        before_start = lag.seconds()
        lag.start()
        await asyncio.sleep(0.1)
        idle = lag.seconds()
        time.sleep(0.4)
        await asyncio.sleep(0.001)  # the monitor records its late wake-up
        after_stall = lag.seconds()
        await lag.stop()
        return before_start, idle, after_stall

    before_start, idle, after_stall = asyncio.run(go())
    assert before_start == 0.0 and idle < 0.05 and after_stall < 0.05


def test_a_loop_that_stays_behind_reads_as_behind_and_recovers() -> None:
    """Every wake-up late (a saturated loop): the lag is the least of the last two; then on time again."""
    async def go() -> tuple[float, float, float]:
        lag = admission.LoopLag(interval=0.01)
        lag.start()
        for _ in range(20):  # each iteration of the loop takes 0.05 s (a wake-up takes a few of them)
            time.sleep(0.05)
            await asyncio.sleep(0)
        behind = lag.seconds()
        await asyncio.sleep(0.1)
        recovered = lag.seconds()
        await lag.stop()
        return behind, recovered, lag.seconds()

    behind, recovered, stopped = asyncio.run(go())
    assert 0.05 <= behind < 0.5
    assert recovered < 0.05 and stopped == 0.0


def test_the_guarded_routes_are_the_ones_that_bring_new_work() -> None:
    routes = [r for router in (jobs.router, compat.router, health.router) for r in router.routes]
    assert admission.guarded_paths(routes, NEW_WORK) == {
        ("POST", "/v1/jobs"), ("GET", "/toxicity"), ("POST", "/toxicity/batch")}


def test_a_guarded_route_must_exist_and_have_a_fixed_path() -> None:
    router = APIRouter()

    @router.get("/things/{thing_id}")
    async def get_thing(thing_id: str) -> str:
        return thing_id

    async def unrouted() -> None:
        return None

    with pytest.raises(ValueError, match="path parameters"):
        admission.guarded_paths(router.routes, [get_thing])
    with pytest.raises(ValueError, match="no route serves"):
        admission.guarded_paths(router.routes, [unrouted])
