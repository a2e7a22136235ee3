"""Reading rows and resuming outputs: torn last rows are cut off, complete rows are counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from toxfleet.cli import table


def write(path: Path, fmt: str, rows: list[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        table.Writer(f, fmt).write(rows)


def test_jsonl_torn_last_line_is_cut(tmp_path: Path) -> None:
    """A JSONL output ending in half a line resumes after its last complete row, the torn part removed."""
    out = tmp_path / "o.jsonl"
    write(out, "jsonl", [{"text": "a", "x": 1}, {"text": "b", "x": 2}])
    with open(out, "a") as f:
        f.write('{"text": "c", "x"')
    resume = table.inspect_output(str(out), "jsonl")
    assert resume.rows == 2 and resume.last == {"text": "b", "x": 2}
    assert out.read_text().endswith('"x": 2}\n')


def test_csv_with_quoted_newlines_and_torn_record(tmp_path: Path) -> None:
    """CSV records spanning lines count once; a record cut inside its quotes is removed."""
    out = tmp_path / "o.csv"
    write(out, "csv", [{"text": "line one\nline two", "toxicity": 0.5}, {"text": 'say "hi"', "toxicity": 0.1}])
    complete = out.read_bytes()
    with open(out, "a") as f:
        f.write('"unfinished\nquote')
    resume = table.inspect_output(str(out), "csv")
    assert resume.rows == 2 and resume.header == ["text", "toxicity"]
    assert resume.last == {"text": 'say "hi"', "toxicity": "0.1"}
    assert out.read_bytes() == complete


def test_csv_header_only_means_no_rows(tmp_path: Path) -> None:
    """An output holding only its header resumes at row 0 and keeps that header."""
    out = tmp_path / "o.csv"
    out.write_text("text,toxicity\n")
    assert table.inspect_output(str(out), "csv") == table.Resume(0, ["text", "toxicity"], None)


def test_jsonl_rows_without_text_are_kept_with_an_error(tmp_path: Path) -> None:
    """Input rows that are not objects, not JSON, or lack the field come through with an error, in place."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n"bare string"\n{"body": "x"}\nnot json\n\n{"text": 3}\n')
    rows = list(table.read_rows(str(src), "jsonl", "text"))
    assert [r.number for r in rows] == [0, 1, 2, 3, 4]
    assert [r.text for r in rows] == ["ok", "bare string", None, None, None]
    assert all(r.error for r in rows[2:])
    assert json.dumps(rows[1].fields) == '{"text": "bare string"}'


def test_gzipped_input_is_read_like_plain(tmp_path: Path) -> None:
    plain = tmp_path / "in.csv"
    plain.write_text('id,text\n1,"hello\nthere"\n2,bye\n', encoding="utf-8")
    packed = tmp_path / "in.csv.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert table.guess_format(str(packed)) == "csv"
    rows = list(table.read_rows(str(packed), "csv", "text"))
    assert [r.text for r in rows] == [r.text for r in table.read_rows(str(plain), "csv", "text")]
    assert [r.text for r in rows] == ["hello\nthere", "bye"]


def test_gzipped_output_is_refused_before_anything_is_touched(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl.gz"
    out.write_bytes(gzip.compress(b'{"text": "a"}\n'))
    before = out.read_bytes()
    for call in (lambda: table.inspect_output(str(out), "jsonl"), lambda: table.open_output(str(out))):
        with pytest.raises(SystemExit, match="gzip output is not supported"):
            call()
    assert out.read_bytes() == before
