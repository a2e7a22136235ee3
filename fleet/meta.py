"""A task's result meta: the JSON Celery's Redis backend stores under a task's result key.

Written by the workers (STARTED when a batch claims a request, then the final result), by the API
(a job answered from the score cache is stored exactly as a worker would store it) and read by the
API (job views, long-polls) and the sweeper. Celery reads `status`, `result`, `traceback`,
`children`, `date_done` and `task_id`; toxfleet adds `model` (who scored it), `backend` (the
worker's backend that scored it, from workers that say), `batch` and
`cache_hits` (texts answered from the score cache) and `started_at` (ISO 8601 UTC, when the batch
that scored it started; on STARTED and final metas), which Celery ignores. The worker's claim script
(`worker.results`) also tests `status` against `FINAL_STATES` in Lua.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
STARTED = "STARTED"
FINAL_STATES = frozenset({SUCCESS, FAILURE})


def build(status: str, result: Any, *, task_id: str, date_done: str | None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta to store (encode it with the backend's serializer, or `json.dumps`); key order is Celery's."""
    return {"status": status, "result": result, "traceback": None, "children": [], "date_done": date_done,
            **(extra or {}), "task_id": task_id}


@dataclass(frozen=True)
class Meta:
    """A stored meta, as toxfleet reads it."""

    status: str | None
    result: Any = None
    model: str | None = None
    cache_hits: int = 0
    started_at: str | None = None
    date_done: str | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATES

    @property
    def error(self) -> str:
        """A failure's `ExcType: message`, from the exception Celery stored as its result."""
        result = self.result
        if isinstance(result, dict) and "exc_type" in result:
            return f"{result['exc_type']}: {result.get('exc_message', '')}".strip()
        return str(result)


def parse(raw: bytes | str | None) -> Meta | None:
    """The meta stored under a key, None when there is none."""
    if raw is None:
        return None
    data: dict[str, Any] = json.loads(raw)
    return Meta(data.get("status"), data.get("result"), data.get("model") or None, int(data.get("cache_hits") or 0),
                data.get("started_at") or None, data.get("date_done") or None)


def status_of(raw: bytes | str | None) -> str | None:
    """The stored status, None when there is none or it cannot be read (never raises)."""
    if not raw:
        return None
    try:
        meta = parse(raw)
    except (ValueError, AttributeError):
        return None
    return str(meta.status) if meta is not None and meta.status else None
