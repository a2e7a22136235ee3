"""What the fidelity gate spends, on the tiny checkpoint with a small corpus and a real export: the
reference's scores kept at export and reused by the gate (not scored again), a kept file made for
anything else ignored with a line saying why, candidates timed first and a slower one not judged, a
judgment that stops at the pass proving a miss, and the progress lines of the gate's command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from testing import ROOT
from worker import export
from worker.backends import loader
from worker.backends.base import Backend
from worker.gate import fidelity
from worker.gate.cli import choose, format_table
from worker.gate.compare import compare
from worker.gate.fidelity import NOT_JUDGED, gate_texts, run_gate
from worker.gate.record import GateRecord
from worker.gate.reference import ReferenceScores
from worker.onnx_export import artifacts
from worker.settings import WorkerSettings

TEXTS = 48
"""Corpus size of these tests: a few passes, a few seconds per backend on the tiny checkpoint."""


@pytest.fixture
def private(exported: WorkerSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerSettings, Path]:
    """A copy of the export for one test (settings, its directory), also as TOXFLEET_* for the commands."""
    directory, _ = artifacts.export_location(exported)
    target = tmp_path / "exports" / directory.name
    shutil.copytree(directory, target)
    settings = exported.model_copy(update={"export_dir": tmp_path / "exports"})
    monkeypatch.setenv("TOXFLEET_CHECKPOINT", str(settings.checkpoint))
    monkeypatch.setenv("TOXFLEET_HF_CONFIG", str(settings.hf_config))
    monkeypatch.setenv("TOXFLEET_EXPORT_DIR", str(settings.export_dir))
    return settings, target


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each backend the gate scores the corpus with for fidelity, in order (the real
    `fidelity.score`, watched)."""
    names: list[str] = []
    real = fidelity.score

    def watched(backend: Backend, *args: Any, **kwargs: Any) -> list[list[float]]:
        names.append(backend.name)
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(fidelity, "score", watched)
    return names


def _slowed(monkeypatch: pytest.MonkeyPatch, name: str, slower: float = 4.0, shift: float = 0.0) -> None:
    """Backend `name`, as the gate loads it, really scores each pass, then sleeps `slower` times what the
    pass took (and 20 ms more) and adds `shift` to every probability: a candidate surely slower than the
    reference (torch-int8 is within 2x of torch on the tiny checkpoint), or surely off."""
    real = loader.load_backend

    def load(backend_name: str, settings: WorkerSettings) -> Backend:
        backend = real(backend_name, settings)
        if backend_name == name:
            predict = backend.predict

            def slow(batch: Sequence[Sequence[int]]) -> list[list[float]]:
                started = time.perf_counter()
                rows = predict(batch)
                if slower:
                    time.sleep(slower * (time.perf_counter() - started) + 0.02)
                return [[p + shift for p in row] for row in rows]

            backend.predict = slow  # type: ignore[method-assign]
        return backend

    monkeypatch.setattr(fidelity, "load_backend", load)


def test_export_keeps_the_reference_scores_and_the_gate_reuses_them(
        private: tuple[WorkerSettings, Path], scored: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m worker.export --no-gate` keeps the reference's scores of the gate corpus in the export
    directory; a gate then reads them: the reference scores no corpus text (the record's pass-by-pass
    count, and no fidelity scoring by torch), and its row is the one the kept scores give."""
    settings, directory = private
    assert not (directory / artifacts.REFERENCE_FILE).exists()
    assert export.main(["--no-gate", "--texts", str(TEXTS)]) == 0
    assert "reference torch: 100% (48/48 texts)" in capsys.readouterr().err
    assert scored == ["torch"]
    kept = ReferenceScores(**json.loads((directory / artifacts.REFERENCE_FILE).read_text()))
    assert kept.key["checkpoint_sha256"] == directory.name and kept.key["corpus"]["texts"] == TEXTS
    assert kept.key["corpus"]["seed"] == fidelity.GATE_SEED and len(kept.scores) == TEXTS

    scored.clear()
    record = GateRecord()
    rows = run_gate(settings, ["onnx"], gate_texts(TEXTS), record=record, judge=["onnx"])
    assert record.reference == "cached" and record.reference_texts_scored == 0
    assert "torch" not in scored and scored == ["onnx"]
    assert not any(step["step"] == "reference scores" for step in record.steps)
    assert [s["step"] for s in record.steps if s["backend"] == "torch"] == ["load", "speed"]  # timed here all the same
    n = len(kept.alone)
    assert rows[0].max_abs == compare(kept.alone, kept.scores[:n]).max_abs and rows[0].texts_per_s > 0
    assert rows[1].passed, rows[1]

    # Without the kept scores the same gate scores the corpus with the reference: the counter counts it.
    scored.clear()
    record = GateRecord()
    run_gate(settings, ["onnx"], gate_texts(TEXTS), record=record, judge=["onnx"], cache=False)
    assert record.reference == "computed" and record.reference_texts_scored == TEXTS
    assert scored == ["torch", "onnx"]


def test_kept_scores_for_another_corpus_or_checkpoint_or_unreadable_are_ignored_with_a_line(
        private: tuple[WorkerSettings, Path], scored: list[str]) -> None:
    """A kept file made on another corpus, for another checkpoint, or unreadable is not trusted: the gate
    says why, scores the corpus with the reference and keeps the new scores."""
    settings, directory = private
    path = directory / artifacts.REFERENCE_FILE
    lines: list[str] = []
    record = GateRecord()
    run_gate(settings, [], gate_texts(TEXTS), lines.append, record=record)
    assert record.reference == "computed" and Path(str(record.stored)).resolve() == path.resolve() and path.is_file()
    assert not any("ignoring" in line for line in lines)  # nothing was kept: nothing to ignore

    lines.clear()
    record = GateRecord()
    run_gate(settings, [], gate_texts(TEXTS - 8), lines.append, record=record)
    assert record.reference == "computed" and record.reference_texts_scored == TEXTS - 8
    (line,) = [line for line in lines if "ignoring kept scores" in line]
    assert f"were made on another corpus ({TEXTS} texts, seed 4242" in line and "scoring again" in line
    assert json.loads(path.read_text())["key"]["corpus"]["texts"] == TEXTS - 8  # the new scores are kept

    data = json.loads(path.read_text())
    data["key"]["checkpoint_sha256"] = "0" * 64
    path.write_text(json.dumps(data))
    lines.clear()
    record = GateRecord()
    run_gate(settings, [], gate_texts(TEXTS - 8), lines.append, record=record)
    assert record.reference == "computed"
    assert any("were made for checkpoint sha256 000000000000, this one is " + directory.name[:12] in line
               for line in lines), lines

    path.write_text('{"key": {"format": 1}, "labels": ')
    lines.clear()
    record = GateRecord()
    run_gate(settings, [], gate_texts(TEXTS - 8), lines.append, record=record)
    assert record.reference == "computed"
    assert any("ignoring kept scores: unreadable reference scores" in line for line in lines), lines
    assert scored.count("torch") == 4


def test_a_candidate_slower_than_the_best_is_timed_but_not_judged(
        private: tuple[WorkerSettings, Path], scored: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Speed first: a candidate slower than the reference (a real backend made slow) gets its speed and
    a `not judged` row, and is never scored for fidelity; `choose` is unchanged; `judge` forces it."""
    settings, _ = private
    _slowed(monkeypatch, "torch-int8")
    lines: list[str] = []
    rows = run_gate(settings, ["torch-int8"], gate_texts(TEXTS), lines.append)
    row = rows[1]
    assert not row.judged and not row.passed and row.texts_per_s > 0
    assert row.error == f"{NOT_JUDGED}: slower than torch ({rows[0].texts_per_s:.1f} texts/s)"
    assert row.texts_per_s < rows[0].texts_per_s
    assert "torch-int8" not in scored
    assert choose(rows) == "torch"
    assert "| torch-int8 | reduced | 0 | - | - | - | - |" in format_table(rows)
    assert any(line.startswith("[1/1] torch-int8: ") and "texts/s" in line for line in lines), lines

    forced = run_gate(settings, ["torch-int8"], gate_texts(TEXTS), judge=["torch-int8"])
    assert forced[1].judged and forced[1].error is None and forced[1].texts > 0  # (random weights: int8 misses)
    assert scored.count("torch-int8") == 1


def test_a_judgment_stops_at_the_pass_that_proves_a_miss(
        private: tuple[WorkerSettings, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate off by more than its budget's maximum fails on its first pass; the row says where it
    stopped. `full` judges it on every text, to the same verdict."""
    settings, _ = private
    _slowed(monkeypatch, "onnx", slower=0.0, shift=0.01)
    rows = run_gate(settings, ["onnx"], gate_texts(TEXTS), judge=["onnx"])
    row = rows[1]
    assert not row.passed and row.judged and row.error is None
    assert row.stopped is not None and row.stopped.startswith("stopped after ") and "max abs" in row.stopped
    assert 0 < row.texts < TEXTS
    full = run_gate(settings, ["onnx"], gate_texts(TEXTS), full=True)[1]
    assert not full.passed and full.stopped is None and full.texts == TEXTS


def test_gate_command_reports_each_candidate_and_each_tenth(private: tuple[WorkerSettings, Path]) -> None:
    """`python -m worker.gate` prints a line per candidate and the percentage of each long step (at most
    one line per 10 %) to stderr; its `--timing` record says the reference's scores came from the export."""
    settings, directory = private
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

    def gate(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "worker.gate", "--texts", str(TEXTS), "--backends",
                               "onnx,onnx-int8", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)

    first = gate("--require", "onnx")  # judged whatever its speed here (on some CPUs tiny's onnx trails torch)
    assert first.returncode == 0, first.stderr[-3000:]
    err = first.stderr.splitlines()
    reference = [line for line in err if line.startswith("gate: reference torch: ") and "%" in line]
    assert 5 <= len(reference) <= 10 and reference[-1].endswith("100% (48/48 texts)"), err
    assert any(line.startswith("gate: [1/2] onnx: ") and "x torch" in line for line in err), err
    assert any(line.startswith("gate: [2/2] onnx-int8: ") and "x torch" in line for line in err), err
    judged = [line for line in err if " fidelity: " in line and "%" in line]
    assert judged and len(judged) <= 2 * 10, err

    timing = directory.parent / "timing.json"
    second = gate("--timing", str(timing))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "gate: reference torch: scores of 48 texts kept at " in second.stderr
    assert not any(line.startswith("gate: reference torch: ") and "%" in line for line in second.stderr.splitlines())
    record = json.loads(timing.read_text())
    assert record["reference"] == "cached" and record["reference_texts_scored"] == 0 and record["seconds"] > 0
