"""The pending record: every task the API sent that has no final result yet, with its arguments.

kombu's Redis transport can lose a popped message (see `worker.sweeper`), so the API records each
task here before its message exists, the worker that stores the task's final result forgets it, and
the sweeper re-publishes what it finds nowhere else. Two keys: `PENDING_KEY` (task id -> unix time its
current message was published) and `PENDING_ARGS_KEY` (task id -> JSON `{"args", "kwargs"}`).

Functions that write take a pipeline (sync or asyncio; they only queue commands), so the record
always changes in the same round trip as whatever it goes with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import redis

from fleet.keys import PENDING_ARGS_KEY, PENDING_KEY

Call = tuple[list[Any], dict[str, Any] | None]
"""A task's `(args, kwargs)`, as sent and as re-sent."""


def record(pipe: Any, calls: Mapping[str, Call], sent_at: float) -> None:
    """Record tasks (task id -> call) as sent at `sent_at`."""
    pipe.zadd(PENDING_KEY, dict.fromkeys(calls, sent_at))
    pipe.hset(PENDING_ARGS_KEY, mapping={t: json.dumps({"args": a, "kwargs": k}) for t, (a, k) in calls.items()})


def forget(pipe: Any, task_ids: Sequence[str]) -> None:
    """Drop tasks: finished, never sent, or expired."""
    if task_ids:
        pipe.zrem(PENDING_KEY, *task_ids)
        pipe.hdel(PENDING_ARGS_KEY, *task_ids)


def restamp(client: Any, task_id: str, sent_at: float) -> None:
    """Move a task's publish time to its new message's (only while it is still pending)."""
    client.zadd(PENDING_KEY, {task_id: sent_at}, xx=True)


def sent_before(client: redis.Redis, ceiling: float, page: int) -> list[tuple[str, float]]:
    """`(task id, publish time)` of every task published before `ceiling`, read `page` at a time."""
    pending: list[tuple[str, float]] = []
    offset = 0
    while True:
        rows = cast(list[tuple[bytes, float]], client.zrangebyscore(
            PENDING_KEY, "-inf", f"({ceiling}", start=offset, num=page, withscores=True))
        pending += [(t.decode(), float(s)) for t, s in rows]
        if len(rows) < page:
            return pending
        offset += page


def calls(client: redis.Redis, task_ids: Iterable[str]) -> list[Call | None]:
    """The recorded calls of `task_ids`, in order (None: no longer pending)."""
    ids = list(task_ids)
    raws = cast(list[bytes | None], client.hmget(PENDING_ARGS_KEY, ids)) if ids else []
    out: list[Call | None] = []
    for raw in raws:
        body = json.loads(raw) if raw is not None else None
        out.append((body["args"], body.get("kwargs")) if body is not None else None)
    return out
