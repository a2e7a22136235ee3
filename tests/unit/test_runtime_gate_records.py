"""The runtime gate's pure parts: which Redis decision records are trusted, the decision key, the
shared switch the pool processes follow, and the heartbeat's new fields read by any API version."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.keys import Heartbeat, gate_key
from worker.gate import shared
from worker.gate.decision import DECISION_FORMAT, Decision
from worker.onnx_export.artifacts import EXPORT_FORMAT
from worker.settings import WorkerSettings
from worker.state import Switch

SHA = "ab" * 32


def _record(**changes: object) -> str:
    decision = Decision(checkpoint_sha256=SHA, chosen="onnx", rows=[{"backend": "onnx", "passed": True}],
                        threads=1, texts=64)
    return json.dumps(dataclasses.asdict(dataclasses.replace(decision, **changes)))  # type: ignore[arg-type]


def test_a_record_made_here_for_this_checkpoint_is_trusted() -> None:
    found = shared.parse_decision(_record(), SHA)
    assert isinstance(found, Decision) and found.chosen == "onnx"


@pytest.mark.parametrize(("raw", "because"), [
    ("{not json", "unreadable decision record"),
    ("[1, 2]", "unreadable decision record (a JSON list"),
    (json.dumps({"chosen": "onnx"}), "unreadable decision record"),
    (json.dumps({**json.loads(_record()), "surprise": 1}), "unreadable decision record"),
    (_record(format=DECISION_FORMAT - 1), f"decision format {DECISION_FORMAT - 1}"),
    (_record(checkpoint_sha256="cd" * 32), "decision was made for another checkpoint"),
    (_record(kernel_signature="amx_int8,some_other_cpu"), "decision was made on a CPU with [amx_int8,some_other_cpu]"),
    (_record(int8_recipe={"activations": "per-tensor"}), "another int8 recipe"),
    (_record(export_format=EXPORT_FORMAT - 1), f"export format {EXPORT_FORMAT - 1}'s graphs"),
    (_record(versions={"torch": "0.0.1", "onnxruntime": "0.0.1", "transformers": "0.0.1"}), "decision was made with"),
    ("x" * (shared.MAX_RECORD_BYTES + 1), "bytes (more than"),
])
def test_a_record_that_does_not_hold_here_is_refused_with_the_reason(raw: str, because: str) -> None:
    found = shared.parse_decision(raw, SHA)
    assert isinstance(found, str) and because in found, found


def test_the_decision_key_changes_with_the_checkpoint_and_names_one_record_per_kind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    key = shared.decision_key(SHA)
    assert shared.decision_key(SHA) == key
    assert shared.decision_key(SHA) != shared.decision_key("cd" * 32)
    monkeypatch.setattr(shared, "EXPORT_FORMAT", EXPORT_FORMAT + 1)
    assert shared.decision_key(SHA) != key, "another export format's graphs need their own decision"
    assert gate_key("lock", "k") == "toxfleet:gate:lock:k" and gate_key("decision", "k") != gate_key("lock", "k")
    with pytest.raises(ValueError):
        gate_key("anything", "k")


def test_the_switch_bumps_its_generation_on_every_change() -> None:
    switch = Switch("torch")
    assert switch.read() == (0, "torch")
    assert switch.set("onnx") == 1
    assert switch.read() == (1, "onnx")
    assert switch.set("torch-bf16-compiled") == 2 and switch.read() == (2, "torch-bf16-compiled")


def test_the_heartbeat_carries_why_and_the_runtime_gate_and_reads_older_beats() -> None:
    gating = {"state": "gating", "key": "abc", "progress": "gate: onnx 40%"}
    beat = Heartbeat("w@h", backend="torch", why="reference: no decision", gating=gating)
    assert Heartbeat.decode(beat.encode()) == beat
    old = Heartbeat.decode(json.dumps({"hostname": "w@h", "backend": "torch"}))
    assert old.why is None and old.gating is None
    assert Heartbeat.decode(json.dumps({"hostname": "w@h", "why": 3, "gating": "x"})).gating is None


def test_the_heartbeat_says_how_its_backend_was_chosen() -> None:
    """`chosen_by`, the label ToxfleetFastPathLost reads: only `auto` with no decision is a fallback; a
    decision that chose the reference is not."""
    figures = {"texts_per_s": 20.0}
    assert Heartbeat("w@h", backend="torch", configured="auto").chosen_by == "fallback"
    assert Heartbeat("w@h", backend="torch", configured="auto", gate=figures).chosen_by == "gate"
    assert Heartbeat("w@h", backend="onnx", configured="auto", gate=figures).chosen_by == "gate"
    assert Heartbeat("w@h", backend="torch", configured="torch").chosen_by == "name"
    assert Heartbeat("w@h", backend="torch").chosen_by == "unknown"


def test_gate_backends_must_name_backends() -> None:
    assert WorkerSettings(gate_backends="onnx,onnx-int8").gate_backends == "onnx,onnx-int8"
    with pytest.raises(ValueError, match="onnx_int8 not among"):
        WorkerSettings(gate_backends="onnx,onnx_int8")


def test_a_checkpoint_is_hashed_once_per_process_while_it_is_unchanged(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The main process hashes the checkpoint once (its pool processes inherit the hash by fork); a
    changed file is hashed again."""
    from worker.onnx_export import artifacts

    checkpoint = tmp_path / "model.ckpt"
    checkpoint.write_bytes(b"weights" * 100)
    hashed: list[Path] = []
    real = artifacts.sha256_file

    def counted(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(artifacts, "sha256_file", counted)
    settings = WorkerSettings(checkpoint=checkpoint)
    first = artifacts.export_location(settings)
    assert artifacts.export_location(settings) == first and artifacts.export_location(settings) == first
    assert hashed == [checkpoint.resolve()]
    checkpoint.write_bytes(b"other weights" * 100)
    assert artifacts.export_location(settings)[1] != first[1] and len(hashed) == 2
