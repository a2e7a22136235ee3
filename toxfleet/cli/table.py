"""Rows in and out of JSONL and CSV files, written so that an interrupted run can resume.

Output rows are written in input order, each job's rows in one write, so the output is always a
prefix of the finished file: a re-run counts the complete rows already there, cuts off a partial
last row (left by a kill mid-write), checks that the last complete row is the input row it claims
to be, and carries on from the next input row.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMATS = ("jsonl", "csv")
ERROR_FIELD = "error"
"""Output field of a row that could not be scored (empty in CSV, absent in JSONL, for scored rows)."""
FLAGGED_FIELD = "flagged"
"""Output field: whether any label is at or above its threshold."""


def guess_format(path: str) -> str:
    return "csv" if path.lower().endswith((".csv", ".csv.gz")) else "jsonl"


def is_gzipped(path: str) -> bool:
    return path.lower().endswith(".gz")


def _open_input(path: str) -> IO[str]:
    """A text reader of the input; `.gz` inputs are decompressed on the fly."""
    if is_gzipped(path):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115 - the caller closes it


@dataclass
class Row:
    """An input row: its fields, and its text (None, with `error` set, when it has none to score)."""

    number: int  # 0-based position among the input's rows
    fields: dict[str, Any]
    text: str | None
    error: str | None = None


def read_rows(path: str, fmt: str, field: str) -> Iterator[Row]:
    """The input's rows in order (JSONL: one object a line, blank lines skipped; CSV: with a header)."""
    with _open_input(path) as f:
        if fmt == "csv":
            reader = csv.DictReader(f)
            if reader.fieldnames is None or field not in reader.fieldnames:
                raise SystemExit(f"toxfleet: {path} has no column {field!r} (columns: {reader.fieldnames})")
            for n, record in enumerate(reader):
                text = record[field]
                # A row shorter than the header has None in the missing columns.
                yield Row(n, dict(record), text, None if text is not None else f"row {n + 1} has no {field!r} value")
            return
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                yield Row(n, {"line": lineno}, None, f"line {lineno} is not JSON: {exc}")
            else:
                if isinstance(value, str):
                    value = {field: value}
                if not isinstance(value, dict):
                    yield Row(n, {"line": lineno}, None, f"line {lineno} is not a JSON object")
                elif not isinstance(value.get(field), str):
                    yield Row(n, value, None, f"line {lineno} has no string field {field!r}")
                else:
                    yield Row(n, value, value[field])
            n += 1


def count_rows(path: str, fmt: str, field: str) -> int:
    return sum(1 for _ in read_rows(path, fmt, field))


def _complete_records(path: str, fmt: str) -> tuple[list[Any], int]:
    """The complete records at the start of an output file, and the byte offset where they end."""
    records: list[Any] = []
    end = 0
    with open(path, "rb") as f:
        data = f.read()
    if fmt == "jsonl":
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line) if line.strip() else None)
            except ValueError:
                break
            end += len(line)
        return [r for r in records if r is not None], end
    # CSV: a record may span lines (quoted newlines). Feed the reader line by line and note where
    # each record ends; a record cut short is either unterminated (no final newline) or leaves a
    # quote open (csv.Error), and is not counted.
    lines = data.splitlines(keepends=True)
    consumed = 0

    def feed() -> Iterator[str]:
        nonlocal consumed
        for line in lines:
            consumed += len(line)
            yield line.decode("utf-8", errors="replace")

    try:
        for record in csv.reader(feed(), strict=True):
            if consumed == len(data) and not data.endswith(b"\n"):
                break
            records.append(record)
            end = consumed
    except csv.Error:
        pass
    return records, end


@dataclass
class Resume:
    """What an existing output holds: complete rows, the CSV header, the last row's fields."""

    rows: int
    header: list[str] | None
    last: dict[str, Any] | None


def inspect_output(path: str, fmt: str) -> Resume:
    """Count the complete rows of an existing output, cutting off a torn last row in place."""
    _refuse_gzip_output(path)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return Resume(0, None, None)
    records, end = _complete_records(path, fmt)
    if end < os.path.getsize(path):
        with open(path, "rb+") as f:
            f.truncate(end)
    if fmt == "jsonl":
        return Resume(len(records), None, records[-1] if records else None)
    if not records:
        return Resume(0, None, None)
    header = [str(h) for h in records[0]]
    last = dict(zip(header, records[-1], strict=True)) if len(records) > 1 else None
    return Resume(len(records) - 1, header, last)


class Writer:
    """Appends output rows, each call's rows in one write followed by a flush and fsync."""

    def __init__(self, out: IO[str], fmt: str, header: list[str] | None = None) -> None:
        self._out = out
        self._fmt = fmt
        self.header = header

    def write(self, rows: Sequence[dict[str, Any]], header: list[str] | None = None) -> None:
        if not rows:
            return
        buffer = io.StringIO()
        if self._fmt == "jsonl":
            for row in rows:
                buffer.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            if self.header is None:
                self.header = header or list(rows[0])
                csv.writer(buffer, lineterminator="\n").writerow(self.header)
            writer = csv.DictWriter(buffer, self.header, restval="", extrasaction="ignore", lineterminator="\n")
            for row in rows:
                writer.writerow({k: _cell(v) for k, v in row.items()})
        self._out.write(buffer.getvalue())
        self._out.flush()
        if self._out.fileno() > 2:  # a file, not stdout: make the rows durable before counting them done
            os.fsync(self._out.fileno())


def _cell(value: Any) -> Any:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else value


def _refuse_gzip_output(path: str) -> None:
    if is_gzipped(path):
        # Resuming needs the rows already written, and a gzip stream cut by a kill mid-write cannot be
        # appended to safely: write plain text and compress it when the run is done.
        raise SystemExit(f"toxfleet: {path}: gzip output is not supported (resumable output must be plain "
                         "text); write it without .gz and compress it afterwards")


def open_output(path: str) -> IO[str]:
    _refuse_gzip_output(path)
    if path == "-":
        return sys.stdout
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - the caller closes it
