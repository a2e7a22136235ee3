"""The reference's kept scores (`worker.gate.reference`): what the key holds and when a kept file is
refused, and the gate's progress meter: pure logic on small files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.gate.record import Percent
from worker.gate.reference import ReferenceScores, read_reference, reference_key

TEXTS = ["", "ok", "you are awful"]


def _key(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"checkpoint_sha256": "a" * 64, "texts": TEXTS, "seed": 4242, "pass_tokens": 1024,
                               "pass_texts": 16, "overhead_tokens": 16, "check_texts": 2, **changes}
    return reference_key(**args)


def _kept(tmp_path: Path, key: dict[str, Any], scores: list[list[float]] | None = None) -> Path:
    path = tmp_path / "reference.json"
    rows = scores if scores is not None else [[0.1, 0.9], [0.2, 0.8], [0.3, 0.7]]
    return ReferenceScores(key, ["toxicity", "insult"], rows, rows[:2], 1.5).write(path)


def test_kept_scores_are_read_back_exactly_for_the_same_key(tmp_path: Path) -> None:
    path = _kept(tmp_path, _key(), [[0.1 + 1e-17, 1 / 3], [0.2, 0.8], [0.3, 0.7]])
    kept = read_reference(path, _key())
    assert isinstance(kept, ReferenceScores)
    assert kept.scores[0] == [0.1 + 1e-17, 1 / 3] and kept.labels == ["toxicity", "insult"]
    assert kept.cpu  # recorded, not keyed


def test_the_key_holds_corpus_passes_and_versions_but_not_the_cpu() -> None:
    key = _key()
    assert set(key) == {"format", "checkpoint_sha256", "corpus", "passes", "check_texts", "versions"}
    assert set(key["versions"]) == {"torch", "transformers", "detoxify"}
    assert _key(texts=["", "ok", "you are awful!"])["corpus"] != key["corpus"]  # same size, other texts


def test_a_kept_file_for_anything_else_is_refused_saying_what_differs(tmp_path: Path) -> None:
    path = _kept(tmp_path, _key())
    cases = {
        "for checkpoint sha256 aaaaaaaaaaaa, this one is bbbbbbbbbbbb": _key(checkpoint_sha256="b" * 64),
        "on another corpus (3 texts, seed 4242": _key(texts=TEXTS[:2] + ["other"]),
        "with other passes": _key(pass_tokens=512),
    }
    for reason, key in cases.items():
        refused = read_reference(path, key)
        assert isinstance(refused, str) and reason in refused, refused
    versions = _key()
    versions["versions"] = {"torch": "0.0", "transformers": None, "detoxify": None}
    refused = read_reference(path, versions)
    assert isinstance(refused, str) and "with {" in refused and "'torch': '0.0'" in refused


def test_an_unreadable_or_incomplete_file_is_refused(tmp_path: Path) -> None:
    missing = read_reference(tmp_path / "reference.json", _key())
    assert isinstance(missing, str) and missing.startswith("no reference scores at")
    path = tmp_path / "reference.json"
    path.write_text("{not json")
    refused = read_reference(path, _key())
    assert isinstance(refused, str) and refused.startswith("unreadable reference scores")
    path.write_text(json.dumps({"key": _key()}))
    refused = read_reference(path, _key())
    assert isinstance(refused, str) and refused.startswith("unreadable reference scores")
    _kept(tmp_path, _key(), [[0.1, 0.9], [0.2, float("nan")], [0.3, 0.7]])
    refused = read_reference(path, _key())
    assert isinstance(refused, str) and "incomplete or not finite" in refused
    _kept(tmp_path, _key(), [[0.1, 0.9], [0.2, 0.8]])
    refused = read_reference(path, _key())
    assert isinstance(refused, str) and "incomplete or not finite" in refused


def test_progress_reports_at_most_once_per_tenth() -> None:
    lines: list[str] = []
    meter = Percent(lines.append, "onnx fidelity", 1024)
    for _ in range(1024 // 16):
        meter.add(16)
    assert len(lines) == 10 and lines[-1] == "onnx fidelity: 100% (1024/1024 texts)"
    assert lines[0] == "onnx fidelity: 10% (112/1024 texts)"
    lines.clear()
    big = Percent(lines.append, "reference torch", 40)
    big.add(40)  # one pass past every step: one line
    assert lines == ["reference torch: 100% (40/40 texts)"]
