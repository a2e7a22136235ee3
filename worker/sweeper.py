"""Re-publish task messages that Redis lost: the one gap in Celery's at-least-once delivery on Redis.

kombu's Redis transport takes a message with `BRPOP` and only then, in a second command, copies it
into the `unacked` hash from which Redis redelivers it. A worker killed between the two (SIGKILL, the
OOM killer, a Fargate task stopped) while its connection held popped messages loses them: no queue
and no unacked hash has them any more (celery/celery#7950; seen here in CI, a job lost in about one
`test_sigkill_whole_worker_then_replacement` run in two).

The API records every task it sends as pending (`fleet.pending`) before the message exists, and
the worker that stores a task's final result removes it. A sweep finds the pending tasks whose message
is nowhere:

- no result, no lease and no STARTED state (no batch took it);
- not in the unacked hash (no worker holds it);
- not in a queue: each queue (both lanes) is first in, first out, so a message published before the
  oldest of the ones they hand out next has already been popped (a queue whose next message carries
  no publish time, such as a redelivered one, proves nothing and the sweep waits). A lost message is
  re-published in the interactive lane whatever its lane was: rare, and never slower.

A task that looks lost on two sweeps at least `confirm` seconds apart (a live worker's pop and its
unacked copy are milliseconds apart) is published again under the same task id; if the first copy
was not lost after all, the batch that gets the second finds its result stored or its lease taken,
so a task is never scored twice. One worker sweeps at a time (a Redis lock per round).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from fleet import meta, pending
from fleet import redis_url as urls
from fleet.keys import SWEEP_LOCK_KEY, SWEEP_SUSPECTS_KEY, UNACKED_KEY, lease_key
from toxfleet import contract

logger = logging.getLogger(__name__)

GRACE_SECONDS = 5.0
"""Tasks published more recently than this are not looked at: their message may not be in Redis yet."""

SKEW_SECONDS = 2.0
"""Publish times come from several hosts, and a publisher stamps a message just before pushing it:
only tasks stamped this much before the queue's next message count as having left the queue."""

PAGE = 500
"""Pending tasks read per round trip."""

Publish = Callable[[str, list[Any], dict[str, Any] | None], None]
"""`publish(task_id, args, kwargs)`: send the task's message again, under the same task id, and move
its pending time to the new message's publish time (`fleet.pending.restamp`)."""


@dataclass
class SweepReport:
    """What one sweep saw and did."""

    looked_at: int = 0
    suspects: int = 0
    republished: list[str] = field(default_factory=list)
    forgotten: int = 0


def _queue_head_sent_at(client: redis.Redis) -> float | None:
    """Publish time of the oldest message at the head of any queue (each is FIFO, so nothing older
    waits in any): +inf when they are empty, None when a head carries no publish time."""
    heads = [_head_sent_at(client, queue) for queue in contract.QUEUES]
    return None if None in heads else min(h for h in heads if h is not None)


def _head_sent_at(client: redis.Redis, queue: str) -> float | None:
    raw = client.lindex(queue, -1)
    if raw is None:
        return float("inf")
    try:
        sent_at = json.loads(raw)["headers"].get(contract.SENT_AT_HEADER)
        return float(sent_at) if sent_at is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _unacked_task_ids(client: redis.Redis) -> set[str]:
    ids: set[str] = set()
    for _, raw in client.hscan_iter(UNACKED_KEY, count=500):
        try:
            ids.add(str(json.loads(raw)[0]["headers"]["id"]))
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return ids


def sweep(client: redis.Redis, result_key: Callable[[str], bytes | str], publish: Publish, confirm: float,
          expires: float, now: float | None = None) -> SweepReport:
    """One sweep over the pending tasks (see the module docstring); `result_key(task_id)` names a
    task's result meta, `expires` is how long results (and so pending tasks) are kept."""
    now = time.time() if now is None else now
    report = SweepReport()
    head = _queue_head_sent_at(client)
    if head is None:
        return report
    # Only tasks published before the queue's next message can have left the queue.
    ceiling = min(now - GRACE_SECONDS, head - SKEW_SECONDS)
    due = pending.sent_before(client, ceiling, PAGE)
    report.looked_at = len(due)
    if not due:
        client.delete(SWEEP_SUSPECTS_KEY)
        return report
    sent = dict(due)
    unacked: set[str] | None = None
    lost: list[str] = []
    gone: list[str] = []
    for i in range(0, len(due), PAGE):
        page_ids = [t for t, _ in due[i:i + PAGE]]
        with client.pipeline(transaction=False) as pipe:
            for t in page_ids:
                pipe.get(result_key(t))
                pipe.exists(lease_key(t))
            answers = pipe.execute()
        for j, t in enumerate(page_ids):
            stored, leased = answers[2 * j], answers[2 * j + 1]
            status = meta.status_of(stored)
            if status in meta.FINAL_STATES or now - sent[t] > expires:
                gone.append(t)  # stored (the worker's cleanup raced us) or long expired
            elif status is None and not leased:
                if unacked is None:
                    unacked = _unacked_task_ids(client)
                if t not in unacked:
                    lost.append(t)
    # Suspects not found lost again are dropped: they were in flight between two places.
    suspects = {k.decode(): float(v) for k, v in cast(dict[bytes, bytes], client.hgetall(SWEEP_SUSPECTS_KEY)).items()}
    confirmed = [t for t in lost if t in suspects and now - suspects[t] >= confirm]
    waiting = [t for t in lost if t not in confirmed]
    with client.pipeline(transaction=False) as pipe:
        pipe.delete(SWEEP_SUSPECTS_KEY)
        if waiting:
            pipe.hset(SWEEP_SUSPECTS_KEY, mapping={t: suspects.get(t, now) for t in waiting})
        pending.forget(pipe, gone)
        pipe.execute()
    report.forgotten = len(gone)
    report.suspects = len(waiting)
    for t, call in zip(confirmed, pending.calls(client, confirmed), strict=True):
        if call is None:
            continue  # finished meanwhile
        publish(t, *call)
        report.republished.append(t)
        logger.warning("task %s: its message was lost by Redis (no queue, no worker held it); re-published",
                       t, extra={"task_id": t})
    return report


class Sweeper(threading.Thread):
    """Runs `sweep` every `interval` seconds in a worker's main process, one worker per round."""

    def __init__(self, redis_url: str, result_key: Callable[[str], bytes | str], publish: Publish, interval: float,
                 expires: float) -> None:
        super().__init__(name="toxfleet-sweeper", daemon=True)
        self._redis = urls.sync_client(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self._result_key = result_key
        self._publish = publish
        self._interval = interval
        self._expires = expires
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(self._interval):
            try:
                # Slightly shorter than the interval, so the next round's lock is free again.
                if self._redis.set(SWEEP_LOCK_KEY, "1", nx=True, px=int(self._interval * 900)):
                    sweep(self._redis, self._result_key, self._publish, self._interval, self._expires)
            except Exception as exc:  # Redis away or a bad entry: try again next round
                logger.warning("sweep for lost messages failed: %r", exc)

    def stop(self) -> None:
        self._stopping.set()
