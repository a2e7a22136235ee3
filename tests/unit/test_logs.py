"""The JSON log format: one object per line, extra fields kept, and the job a line concerns."""

from __future__ import annotations

import contextvars
import json
import logging
import sys

import pytest

from fleet import logs
from toxfleet import contract


def _format(msg: str, *args: object, name: str = "test", exc: bool = False, **extra: object) -> dict[str, object]:
    record = logging.makeLogRecord({"name": name, "levelname": "INFO", "levelno": logging.INFO, "msg": msg,
                                    "args": args, **extra})
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            record.exc_info = sys.exc_info()
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    parsed: dict[str, object] = json.loads(line)
    return parsed


def test_line_has_message_level_logger_time_and_extra_fields() -> None:
    """The message is interpolated; fields passed with extra= come out as JSON members."""
    entry = _format("batch %s: texts=%d", "b1", 3, batch_id="b1", texts=3)
    assert entry["message"] == "batch b1: texts=3"
    assert entry["level"] == "INFO" and entry["logger"] == "test"
    assert str(entry["time"]).endswith("+00:00")
    assert entry["batch_id"] == "b1" and entry["texts"] == 3
    assert "args" not in entry and "msg" not in entry


def test_job_id_derived_from_a_chunk_task_id() -> None:
    """A line about task `<job>.<n>` names job `<job>`; a task sent directly is its own job."""
    job = "ab" * 16
    assert _format("x", task_id=contract.chunk_task_id(job, 3))["job_id"] == job
    direct = "d9082b21-5c3f-4fdd-8787-e7f749d9ca03"
    assert _format("x", task_id=direct)["job_id"] == direct
    assert "job_id" not in _format("x", task_id="???")  # Celery's placeholder outside a task
    assert _format("x", task_ids=[f"{job}.0", f"{job}.1", "other"])["job_ids"] == sorted([job, "other"])


def test_bound_job_tags_lines_of_the_current_context_only() -> None:
    """bind_job tags later lines in the same context; other contexts stay untagged."""

    def bound() -> dict[str, object]:
        logs.bind_job("c" * 32)
        return _format("inside")

    assert contextvars.copy_context().run(bound)["job_id"] == "c" * 32
    assert "job_id" not in _format("outside")
    assert contextvars.copy_context().run(lambda: _format("explicit", job_id="d" * 32))["job_id"] == "d" * 32


def test_bound_fields_join_later_lines_of_the_context_without_overriding_theirs() -> None:
    """bind_fields adds its fields to later lines in the same context (uvicorn's access line included),
    never over a field the line sets itself (the access line's HTTP `status`), and not elsewhere."""

    def bound() -> tuple[dict[str, object], dict[str, object]]:
        logs.bind_fields(texts=3)
        logs.bind_fields(messages=1, status="succeeded")
        access = _format('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "POST", "/v1/jobs", "1.1", 202,
                         name="uvicorn.access")
        return _format("inside"), access

    inside, access = contextvars.copy_context().run(bound)
    assert (inside["texts"], inside["messages"], inside["status"]) == (3, 1, "succeeded")
    assert (access["texts"], access["messages"], access["status"]) == (3, 1, 202)
    assert "texts" not in _format("outside")


def test_uvicorn_access_line_gets_fields_and_exceptions_are_kept() -> None:
    """uvicorn's access args become fields; a traceback is one JSON string; odd values are stringified."""
    entry = _format('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "GET", "/v1/jobs/x", "1.1", 200, name="uvicorn.access")
    assert (entry["method"], entry["path"], entry["status"]) == ("GET", "/v1/jobs/x", 200)
    failed = _format("oops", exc=True, thing=object())
    assert "ValueError: boom" in str(failed["exc_info"]) and str(failed["thing"]).startswith("<object")


def test_json_mode_reformats_named_loggers(capsys: pytest.CaptureFixture[str]) -> None:
    """use_json switches a server's own handlers to JSON lines."""
    log = logging.getLogger("toxfleet.test.server")
    handler = logging.StreamHandler(sys.stdout)
    log.addHandler(handler)
    log.propagate = False
    try:
        logs.use_json(["toxfleet.test.server"])
        log.warning("hello %s", "world", extra={"job_id": "e" * 32})
    finally:
        log.removeHandler(handler)
    entry = json.loads(capsys.readouterr().out)
    assert entry["message"] == "hello world" and entry["job_id"] == "e" * 32 and entry["level"] == "WARNING"
