"""A worker with no way to get weights exits at start with one clear line instead of looping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testing import ROOT, base_env


def test_worker_without_weights_exits_with_one_clear_line(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    """No checkpoint, offline, empty weight cache: exit non-zero quickly, saying how to provide weights."""
    env = base_env(redis_server.url, None, TORCH_HOME=str(tmp_path / "torch"), TOXFLEET_MODEL="unbiased-small")
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "worker", "worker", "--concurrency", "1"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("toxfleet worker:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "TOXFLEET_CHECKPOINT" in lines[0] and "unbiased-small" in lines[0]


def test_detoxify_urls_match_detoxify() -> None:
    """The weight URLs the main process checks without importing torch are Detoxify's own."""
    from detoxify.detoxify import MODEL_URLS

    from worker.weights import DETOXIFY_URLS

    assert DETOXIFY_URLS == MODEL_URLS
