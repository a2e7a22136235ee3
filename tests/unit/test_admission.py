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


def test_a_loop_stalled_longer_than_the_window_reads_as_behind_at_once_and_recovers() -> None:
    async def go() -> tuple[float, float, float, float]:
        lag = admission.LoopLag(interval=0.02, window=0.2)
        idle_before_start = lag.seconds()
        lag.start()
        await asyncio.sleep(0.3)
        idle = lag.seconds()
        time.sleep(0.4)  # the loop runs nothing else meanwhile: its next wake-up is late
        stalled = lag.seconds()  # before the monitor has run again: the overdue wake-up tells
        await asyncio.sleep(0.1)  # on-time wake-ups again
        recovered = lag.seconds()
        await lag.stop()
        return idle_before_start, idle, stalled, recovered

    idle_before_start, idle, stalled, recovered = asyncio.run(go())
    assert idle_before_start == 0.0
    assert idle < 0.05
    assert 0.35 <= stalled < 1.0
    assert recovered < 0.05


def test_one_slow_iteration_among_on_time_ones_is_not_a_lag() -> None:
    """A burst (many long-polls woken at once) delays one wake-up; the window still holds on-time ones."""
    async def go() -> tuple[float, float]:
        lag = admission.LoopLag(interval=0.02, window=0.25)
        lag.start()
        await asyncio.sleep(0.3)
        time.sleep(0.12)
        during = lag.seconds()
        await asyncio.sleep(0.001)  # the monitor records its late wake-up
        after = lag.seconds()
        await lag.stop()
        return during, after

    during, after = asyncio.run(go())
    assert during < 0.05 and after < 0.05


def test_a_loop_that_stays_behind_reads_as_behind() -> None:
    """Every wake-up of the window late (a saturated loop): the lag is the least of them."""
    async def go() -> float:
        lag = admission.LoopLag(interval=0.01, window=0.2)
        lag.start()
        for _ in range(8):  # each iteration of the loop takes 0.06 s
            time.sleep(0.06)
            await asyncio.sleep(0)
        behind = lag.seconds()
        await lag.stop()
        return behind

    assert 0.03 <= asyncio.run(go()) < 0.2


def test_a_stopped_monitor_reads_no_lag() -> None:
    async def go() -> float:
        lag = admission.LoopLag(interval=0.01)
        lag.start()
        await asyncio.sleep(0.03)
        await lag.stop()
        time.sleep(0.1)
        return lag.seconds()

    assert asyncio.run(go()) < 0.05


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
