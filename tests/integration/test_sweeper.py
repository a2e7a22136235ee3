"""The lost-message sweep against a real Redis, with messages published by a real Celery app exactly as
the API publishes them; "a worker popped it and died" is the `RPOP` kombu's BRPOP does, with nothing
after it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from celery import Celery

from fleet import keys
from testing import RedisServer
from toxfleet import contract
from worker.results import Outcome, ResultStore
from worker.sweeper import sweep

CONFIRM = 10.0
EXPIRES = 3600.0


class Fleet:
    """A Celery app on the test Redis, and what the sweep re-published through it."""

    def __init__(self, url: str) -> None:
        self.app = Celery(broker=url, backend=url, set_as_current=False)
        self.app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                             result_expires=600)
        self.client = redis.Redis.from_url(url)
        self.republished: list[tuple[str, Any, Any]] = []

    def submit(self, task_id: str, texts: list[str], sent_at: float) -> None:
        """What the API does: record the task as pending, then publish its message with the same stamp."""
        self.client.zadd(keys.PENDING_KEY, {task_id: sent_at})
        self.client.hset(keys.PENDING_ARGS_KEY, task_id, json.dumps({"args": [texts], "kwargs": None}))
        self.app.send_task(contract.SCORE_TASK, args=[texts], task_id=task_id, queue=contract.QUEUE,
                           headers={contract.SENT_AT_HEADER: sent_at})

    def pop(self, into_unacked: bool = False) -> None:
        """A worker takes the next message; unless it records it in `unacked`, it died right after."""
        raw = cast(bytes | None, self.client.rpop(contract.QUEUE))
        assert raw is not None
        if into_unacked:
            tag = json.loads(raw)["properties"]["delivery_tag"]
            self.client.hset(keys.UNACKED_KEY, tag, json.dumps([json.loads(raw), "", contract.QUEUE]))

    def publish(self, task_id: str, args: Any, kwargs: Any) -> None:
        self.republished.append((task_id, args, kwargs))

    def sweep(self, now: float) -> Any:
        return sweep(self.client, self.app.backend.get_key_for_task, self.publish, CONFIRM, EXPIRES, now=now)


@pytest.fixture
def fleet(clean_redis: RedisServer) -> Iterator[Fleet]:
    yield Fleet(clean_redis.url)


def test_a_popped_message_nobody_recorded_is_republished_on_the_second_look(fleet: Fleet) -> None:
    """Popped by a worker that died before recording it: suspect on one sweep, re-published with its
    own arguments on the next sweep at least `confirm` seconds later, and only then."""
    t0 = time.time() - 60
    fleet.submit("job.0", ["lost text"], t0)
    fleet.submit("job2.0", ["still queued"], t0 + 10)
    fleet.pop()
    first = fleet.sweep(now=t0 + 60)
    assert first.suspects == 1 and not fleet.republished
    assert fleet.sweep(now=t0 + 65).republished == []  # not yet `confirm` seconds apart
    second = fleet.sweep(now=t0 + 60 + CONFIRM)
    assert second.republished == ["job.0"]
    assert fleet.republished == [("job.0", [["lost text"]], None)]
    assert fleet.client.hlen(keys.SWEEP_SUSPECTS_KEY) == 0


def test_messages_in_the_queue_or_held_by_a_worker_are_left_alone(fleet: Fleet) -> None:
    """Still queued (behind the queue's next message, or that message itself), prefetched by a live
    worker (in `unacked`), being scored (leased), or finished: never re-published."""
    t0 = time.time() - 60
    for i in range(5):
        fleet.submit(f"j{i}.0", [f"text {i}"], t0 + 10 * i)
    fleet.pop(into_unacked=True)  # j0: buffered by a live worker
    fleet.pop(into_unacked=True)  # j1: ... and being scored
    ResultStore(fleet.app.backend).claim(["j1.0"], "batch", 60, {})
    fleet.pop()  # j2: popped by a worker that then stored its result and acked it
    ResultStore(fleet.app.backend).store([Outcome("j2.0", result=[{"toxicity": 0.5}])], {})
    for now in (t0 + 60, t0 + 60 + CONFIRM, t0 + 60 + 2 * CONFIRM):
        report = fleet.sweep(now=now)
        assert report.looked_at == 2  # j0 and j1: j3 and j4 are behind the queue's next message
        assert report.suspects == 0 and report.republished == []
    assert fleet.republished == []
    # The stored result took the task off the pending list with it.
    assert fleet.client.zscore(keys.PENDING_KEY, "j2.0") is None
    assert fleet.client.zcard(keys.PENDING_KEY) == 4


def test_a_suspect_that_turns_up_is_forgiven(fleet: Fleet) -> None:
    """Caught between a live worker's pop and its unacked record: suspect once, then found, not re-sent."""
    t0 = time.time() - 60
    fleet.submit("a.0", ["x"], t0)
    raw = cast(bytes, fleet.client.rpop(contract.QUEUE))
    assert fleet.sweep(now=t0 + 60).suspects == 1
    tag = json.loads(raw)["properties"]["delivery_tag"]
    fleet.client.hset(keys.UNACKED_KEY, tag, json.dumps([json.loads(raw), "", contract.QUEUE]))
    report = fleet.sweep(now=t0 + 60 + CONFIRM)
    assert report.suspects == 0 and report.republished == [] and fleet.client.hlen(keys.SWEEP_SUSPECTS_KEY) == 0


def test_a_queue_head_without_a_publish_time_proves_nothing(fleet: Fleet) -> None:
    """A message sent straight to Celery (no publish time) at the head of the queue: the sweep cannot
    tell what has left the queue, and waits."""
    t0 = time.time() - 60
    fleet.submit("a.0", ["x"], t0)
    fleet.pop()
    fleet.app.send_task(contract.SCORE_TASK, args=[["direct"]], queue=contract.QUEUE)
    for now in (t0 + 60, t0 + 60 + CONFIRM):
        assert fleet.sweep(now=now).suspects == 0
    assert fleet.republished == []
    fleet.client.rpop(contract.QUEUE)  # the direct message is taken: now the lost one shows
    fleet.sweep(now=t0 + 80)
    assert fleet.sweep(now=t0 + 80 + CONFIRM).republished == ["a.0"]
