"""Result writes and request leases against a real Redis: what makes redeliveries harmless."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from testing import RedisServer
from toxfleet.keys import LEASE_PREFIX
from worker.results import Outcome, ResultStore


@pytest.fixture
def store(clean_redis: RedisServer) -> Iterator[tuple[ResultStore, Any]]:
    app = Celery(broker=clean_redis.url, backend=clean_redis.url, set_as_current=False)
    app.conf.update(result_serializer="json", accept_content=["json"], result_expires=600)
    yield ResultStore(app.backend), app


def test_second_claim_while_scoring_is_busy(store: tuple[ResultStore, Any]) -> None:
    """A concurrent redelivery finds the request leased to the batch scoring it."""
    s, app = store
    assert s.claim(["t1", "t2"], "batchA", 60, {"model": "m"}) == ["claimed", "claimed"]
    assert s.claim(["t1", "t3"], "batchB", 60, {"model": "m"}) == ["busy", "claimed"]
    meta = app.backend.get_task_meta("t1")
    assert meta["status"] == "STARTED" and meta["model"] == "m"


def test_claim_after_a_stored_result_is_final(store: tuple[ResultStore, Any]) -> None:
    """Once a result is stored, a redelivery is told so and the lease is gone."""
    s, app = store
    s.claim(["t1"], "batchA", 60, {})
    s.store([Outcome("t1", result=[{"toxicity": 0.5}])], {"model": "m"})
    assert app.backend.client.exists(LEASE_PREFIX + "t1") == 0
    assert s.claim(["t1"], "batchB", 60, {}) == ["final"]
    assert app.backend.get_task_meta("t1")["result"] == [{"toxicity": 0.5}]


def test_release_only_drops_the_batch_s_own_leases(store: tuple[ResultStore, Any]) -> None:
    """After a pool process dies, its batch's leases are released so the retry can claim them;
    a lease held by another batch is left alone."""
    s, _ = store
    s.claim(["t1"], "dead", 60, {})
    s.claim(["t2"], "alive", 60, {})
    s.release(["t1", "t2"], "dead")
    assert s.claim(["t1", "t2"], "retry", 60, {}) == ["claimed", "busy"]


def test_failure_is_stored_as_celery_does(store: tuple[ResultStore, Any]) -> None:
    """A failed request reads back, through Celery's own backend, as the exception with its message."""
    s, app = store
    s.store([Outcome("t9", error=ValueError("texts[0] is not a string"))], {})
    meta = app.backend.get_task_meta("t9")
    assert meta["status"] == "FAILURE"
    assert isinstance(meta["result"], ValueError) and "not a string" in str(meta["result"])
