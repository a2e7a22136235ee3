"""Result writes and request leases against a real Redis: what makes redeliveries harmless."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from fleet.keys import LEASE_PREFIX, cancelled_key
from testing import RedisServer
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


def test_claim_reports_a_deleted_job_and_leaves_it_alone(store: tuple[ResultStore, Any]) -> None:
    """A request whose job was deleted (`DELETE /v1/jobs/{id}` leaves a mark) is "cancelled", read in the
    same script as the claim: no lease is taken and nothing is stored, while its neighbours in the batch
    (another job, a direct call with no job) are claimed as usual."""
    s, app = store
    app.backend.client.set(cancelled_key("gone"), "1")
    assert s.claim(["gone.0", "kept.0", "direct"], "batchA", 60, {}) == ["cancelled", "claimed", "claimed"]
    assert app.backend.client.exists(LEASE_PREFIX + "gone.0") == 0
    assert app.backend.get_task_meta("gone.0")["status"] == "PENDING"  # nothing stored
    assert app.backend.get_task_meta("kept.0")["status"] == "STARTED"


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


def test_a_batch_slower_than_its_lease_keeps_it(store: tuple[ResultStore, Any]) -> None:
    """A batch that runs past one lease (a loaded host) keeps its requests: kombu redelivers them after
    the visibility timeout, and a redelivery must find them busy, not claim and score them again (a
    fault run under load scored and stored 19 of 40 jobs twice that way). Without renewal the same
    wait lets the second claim through."""
    s, _ = store
    assert s.claim(["held", "unheld"], "slow", 1, {}) == ["claimed", "claimed"]
    with s.holding(["held"], "slow", 1):
        time.sleep(2.5)
        assert s.claim(["held", "unheld"], "redelivery", 1, {}) == ["busy", "claimed"]


def test_a_second_final_result_is_neither_stored_nor_published(store: tuple[ResultStore, Any]) -> None:
    """The first final result wins: a later one (a request scored twice however it happened) changes
    nothing and wakes nobody, so every waiter sees one final result per request."""
    s, app = store
    pubsub = app.backend.client.pubsub()
    pubsub.psubscribe("celery-task-meta-*")
    pubsub.get_message(timeout=1)  # the subscription's confirmation
    s.store([Outcome("t1", result=[{"toxicity": 0.5}])], {})
    s.store([Outcome("t1", result=[{"toxicity": 0.9}]), Outcome("t2", result=[{"toxicity": 0.1}])], {})
    published = []
    while (message := pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)) is not None:
        published.append(message["channel"])
    assert published == [b"celery-task-meta-t1", b"celery-task-meta-t2"]
    assert app.backend.get_task_meta("t1")["result"] == [{"toxicity": 0.5}]
