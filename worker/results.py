"""Write a whole batch's outcomes to Celery's Redis result backend in one round trip.

`backend.mark_as_done` costs a round trip per request; a batch of 40 requests would pay 40. This
writes the same keys, the same JSON meta and the same pub/sub notification Celery's Redis backend
does (so `AsyncResult.get()` and the API's long-poll both see it), in one pipeline. The meta
carries two extra fields Celery ignores: `model` and `batch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import states

FINAL_STATES = frozenset({states.SUCCESS, states.FAILURE})


@dataclass(frozen=True)
class Outcome:
    """One request's final result: `result` on success, `error` (an exception) on failure."""

    task_id: str
    result: Any = None
    error: BaseException | None = None

    @property
    def state(self) -> str:
        return str(states.FAILURE if self.error is not None else states.SUCCESS)


class ResultStore:
    """Batch reads and writes of task result meta, compatible with Celery's RedisBackend."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._expires = int(backend.expires) if backend.expires else None

    def _key(self, task_id: str) -> bytes:
        key: bytes = self._backend.get_key_for_task(task_id)
        return key

    def states(self, task_ids: Sequence[str]) -> list[str | None]:
        """Stored state per task id (None when nothing is stored), in one MGET."""
        if not task_ids:
            return []
        raw = self._backend.client.mget([self._key(t) for t in task_ids])
        return [None if value is None else self._backend.decode(value).get("status") for value in raw]

    def _write(self, entries: Iterable[tuple[str, dict[str, Any]]]) -> None:
        with self._backend.client.pipeline(transaction=False) as pipe:
            for task_id, meta in entries:
                key = self._key(task_id)
                value = self._backend.encode({**meta, "task_id": task_id})
                if self._expires:
                    pipe.setex(key, self._expires, value)
                else:
                    pipe.set(key, value)
                pipe.publish(key, value)
            pipe.execute()

    def mark_started(self, task_ids: Sequence[str], extra: dict[str, Any]) -> None:
        """Record that these requests are being scored now (the API reports them as running)."""
        self._write((t, {"status": states.STARTED, "result": None, "traceback": None, "children": [],
                         "date_done": None, **extra}) for t in task_ids)

    def store(self, outcomes: Sequence[Outcome], extra: dict[str, Any]) -> None:
        """Record final results and failures, and wake anyone waiting on them."""
        now = datetime.now(UTC).isoformat()

        def meta(o: Outcome) -> dict[str, Any]:
            result = self._backend.prepare_exception(o.error) if o.error is not None else o.result
            return {"status": o.state, "result": result, "traceback": None, "children": [],
                    "date_done": now, **extra}

        self._write((o.task_id, meta(o)) for o in outcomes)
