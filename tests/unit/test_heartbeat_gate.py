"""The heartbeat's optional `gate` field: written when `auto` chose the backend, and decoded
compatibly both ways (an older worker's beat has none; a malformed one is ignored)."""

from __future__ import annotations

import json

from fleet.keys import Heartbeat


def test_gate_round_trips() -> None:
    gate = {"max_abs": 0.004, "p99_abs": 0.002, "flips_pct": 0.1, "min_spearman": 0.9999, "texts_per_s": 40.0,
            "decided_at": 1.0}
    beat = Heartbeat("w@h", model="m", backend="torch-bf16", gate=gate)
    assert Heartbeat.decode(beat.encode()) == beat


def test_an_older_workers_beat_decodes_without_a_gate() -> None:
    old = json.dumps({"hostname": "w@h", "model": "m", "backend": "torch", "cache": True, "concurrency": 2})
    assert Heartbeat.decode(old).gate is None
    assert Heartbeat.decode(json.dumps({"hostname": "w@h", "gate": "garbage"})).gate is None
