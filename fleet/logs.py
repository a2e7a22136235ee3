"""Log formats both tiers share: `json` (one object per line, for log pipelines) or `text` (people).

A JSON line carries `time`, `level`, `logger`, `message`, every field passed with `extra=`, and the
job it concerns: `job_id` (bound to the current request with `bind_job`, or derived from a Celery
`task_id`) or `job_ids` (passed, or derived from `task_ids`), so that one query on a job id finds
every line on both tiers, and the fields bound to the request with `bind_fields` (uvicorn's access
line then carries a job's counts without a line of its own). Stdlib only.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal

from toxfleet.contract import job_of

LogFormat = Literal["json", "text"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Line format of `text` logs (the worker keeps Celery's own in text mode)."""

_job: ContextVar[str | None] = ContextVar("toxfleet_job_id", default=None)
_fields: ContextVar[dict[str, Any] | None] = ContextVar("toxfleet_log_fields", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` (or a formatter such
# as Celery's TaskFormatter) and is emitted as a field, except uvicorn's copy of the message in colour.
_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


def bind_job(job_id: str) -> None:
    """Tag every later log line of the current request (asyncio task or thread) with `job_id`."""
    _job.set(job_id)


def bind_fields(**fields: Any) -> None:
    """Add `fields` to every later JSON line of the current request (asyncio task or thread), unless
    a line sets them itself: the API binds a job's counts, so its access line carries them."""
    _fields.set({**(_fields.get() or {}), **fields})


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            # uvicorn's access line: (client, method, path, http version, status)
            entry.update(zip(("client", "method", "path", "http_version", "status"), record.args, strict=True))
        _add_job(entry)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _add_job(entry: dict[str, Any]) -> None:
    if "job_id" not in entry:
        task_id = entry.get("task_id")
        if isinstance(task_id, str) and task_id != "???":  # Celery's placeholder outside a task
            entry["job_id"] = job_of(task_id)
        elif (bound := _job.get()) is not None:
            entry["job_id"] = bound
    for key, value in (_fields.get() or {}).items():
        entry.setdefault(key, value)
    if "job_ids" not in entry and isinstance(entry.get("task_ids"), list | tuple):
        entry["job_ids"] = sorted({job_of(t) for t in entry["task_ids"] if isinstance(t, str)})


REDACTED_QUERY_PATHS = ("/toxicity",)
"""Paths whose query string carries the scored text (`GET /toxicity?q=`): access lines drop it."""


class RedactQuery(logging.Filter):
    """Replaces the query string of `REDACTED_QUERY_PATHS` in uvicorn's access lines, so that no
    scored text reaches a log (install it on the `uvicorn.access` logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5 and isinstance(record.args[2], str):
            path, sep, _ = record.args[2].partition("?")
            if sep and path in REDACTED_QUERY_PATHS:
                record.args = (*record.args[:2], f"{path}?[redacted]", *record.args[3:])
        return True


def redact_access_log(logger_name: str = "uvicorn.access") -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler `configure` installs (a class of its own, so it is installed once)."""


def configure(fmt: LogFormat, level: int = logging.INFO, json_loggers: Iterable[str] = ()) -> None:
    """Log our own lines (and anything else propagating to the root logger) to stderr in `fmt`;
    with `json`, also switch the handlers of `json_loggers` (ones a server configured itself) to JSON."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(sys.stderr)
        root.addHandler(handler)
    handler.setFormatter(formatter(fmt))
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    if fmt == "json":
        use_json(json_loggers)


def use_json(logger_names: Iterable[str]) -> None:
    """Switch every handler of these loggers to JSON lines (keeping their streams and levels)."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(JsonFormatter())
