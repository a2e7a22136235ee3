"""`python -m worker.export --prepare` (what `make run` runs before the workers) on the tiny checkpoint
with a private export directory, as separate processes, as scripts/run.sh calls it but on a smaller
corpus and without the compiled candidates (tracing them costs tens of seconds each; the image step's
test in test_backends gates them all). For `auto` it gates only with the runtime gate off (otherwise
the workers gate behind the fleet: test_runtime_gate); then a real worker that `auto` gave the chosen
backend reports it, with its gate figures, in `/readyz`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from testing import ROOT
from testing.services import start_api, start_worker
from worker.gate.decision import Decision
from worker.onnx_export.artifacts import DECISION_FILE

GATED = ("onnx", "onnx-int8", "torch-int8")
"""The candidates these tests gate: quick to load, and fp32 and int8 both among them."""


def _prepare(env: dict[str, str], **extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "worker.export", "--prepare", "--texts", "64",
                           "--backends", ",".join(GATED)], cwd=ROOT, env={**env, **extra}, capture_output=True,
                          text=True, timeout=600)
    return done, time.perf_counter() - started


def _env(tiny_checkpoint: tuple[Path, Path], exports: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update(TOXFLEET_CHECKPOINT=str(tiny_checkpoint[0]), TOXFLEET_HF_CONFIG=str(tiny_checkpoint[1]),
               TOXFLEET_EXPORT_DIR=str(exports), HF_HUB_OFFLINE="1", **extra)
    return env


def test_auto_prepare_leaves_the_gate_to_the_workers(tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    """With the runtime gate on (the default), `make run`'s prepare step does nothing slow for `auto`:
    no export, no gate; it says the workers gate in the background."""
    done, _ = _prepare(_env(tiny_checkpoint, tmp_path / "exports"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no fidelity decision" in done.stdout and "gate this CPU in the background" in done.stdout, done.stdout
    assert "gate:" not in done.stderr
    assert not (tmp_path / "exports").exists()


def test_auto_without_the_runtime_gate_prepares_once_then_says_cached(tiny_checkpoint: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    env = _env(tiny_checkpoint, tmp_path / "exports", TOXFLEET_RUNTIME_GATE="0")
    first, first_s = _prepare(env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "exporting, then gating" in first.stdout and "auto -> " in first.stdout, first.stdout
    assert "gate: reference torch" in first.stderr  # progress while it runs
    (directory,) = [p.parent for p in (tmp_path / "exports").glob(f"*/{DECISION_FILE}")]
    assert [r["backend"] for r in Decision.read(directory).rows] == ["torch", *GATED]
    second, second_s = _prepare(env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "cached decision" in second.stdout and "nothing to do" in second.stdout, second.stdout
    assert "gate:" not in second.stderr
    assert second_s < first_s


def test_readyz_shows_each_workers_backend_and_the_gate_behind_it(tiny_checkpoint: tuple[Path, Path],
                                                                  tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    exports = tmp_path / "exports"
    done, _ = _prepare(_env(tiny_checkpoint, exports, TOXFLEET_RUNTIME_GATE="0"))
    assert done.returncode == 0, done.stdout + done.stderr
    (directory,) = [p.parent for p in exports.glob(f"*/{DECISION_FILE}")]
    decision = Decision.read(directory)
    row = next(r for r in decision.rows if r["backend"] == decision.chosen)
    auto = start_worker(tmp_path, redis_server.url, tiny_checkpoint, name="auto", concurrency=1,
                        env={"TOXFLEET_EXPORT_DIR": str(exports)})
    named = start_worker(tmp_path, redis_server.url, tiny_checkpoint, name="named", concurrency=1,
                         env={"TOXFLEET_EXPORT_DIR": str(exports), "TOXFLEET_BACKEND": "torch"})
    api, url = start_api(tmp_path, redis_server.url)
    try:
        ready = httpx.get(url + "/readyz", timeout=5).json()
        by_host = {b["hostname"]: b for b in ready["backends"]}
        mine = by_host[auto.extra["hostname"]]
        assert mine["backend"] == decision.chosen, ready
        assert mine["gate"]["max_abs"] == row["max_abs"] and mine["gate"]["p99_abs"] == row["p99_abs"]
        assert mine["gate"]["min_spearman"] == row["min_spearman"]
        assert mine["gate"]["flips_pct"] == round(100 * row["flip_fraction"], 3)
        assert mine["gate"]["texts_per_s"] == row["texts_per_s"]
        assert mine["gate"]["decided_at"] == decision.created
        forced = by_host[named.extra["hostname"]]
        assert forced["backend"] == "torch" and forced["gate"] is None, ready
    finally:
        api.stop()
        named.stop()
        auto.stop()


def test_forced_onnx_prepares_the_export_without_the_gate(tiny_checkpoint: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    env = _env(tiny_checkpoint, tmp_path / "exports")
    done, _ = _prepare(env, TOXFLEET_BACKEND="onnx")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prepare: onnx: export" in done.stdout
    assert list((tmp_path / "exports").glob("*/manifest.json"))
    assert not list((tmp_path / "exports").glob(f"*/{DECISION_FILE}"))
    assert "gate:" not in done.stderr


def test_a_torch_backend_needs_nothing(tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    done, _ = _prepare(_env(tiny_checkpoint, tmp_path / "exports"), TOXFLEET_BACKEND="torch-int8-rowwise")
    assert done.returncode == 0 and "nothing to prepare" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "exports").exists()
