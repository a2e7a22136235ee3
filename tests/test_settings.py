"""Settings fail fast on unsafe values, at start, with a message naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.settings import ApiSettings
from worker.settings import WorkerSettings


def test_defaults_are_sane(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no environment, both tiers default to a local Redis and the unbiased-small model."""
    for var in ("REDIS_URL", "TOXFLEET_CHECKPOINT", "TOXFLEET_HF_CONFIG", "TOXFLEET_MODEL"):
        monkeypatch.delenv(var, raising=False)
    w, a = WorkerSettings(), ApiSettings()
    assert w.redis_url == a.redis_url == "redis://127.0.0.1:6379/0"
    assert w.model == "unbiased-small" and w.torch_threads == 1
    assert w.result_expires == a.result_expires and w.visibility_timeout == a.visibility_timeout


@pytest.mark.parametrize("env", [
    {"REDIS_URL": "http://example.com"},
    {"TOXFLEET_TORCH_THREADS": "0"},
    {"TOXFLEET_PASS_TOKENS": "100"},
    {"TOXFLEET_CHECKPOINT": "/nonexistent/model.ckpt"},
    {"TOXFLEET_HF_CONFIG": "/tmp"},
    {"TOXFLEET_CONCURRENCY": "-1"},
])
def test_worker_rejects_unsafe_values(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Each unsafe worker setting is refused at construction."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError):
        WorkerSettings()


@pytest.mark.parametrize("env", [{"REDIS_URL": "ftp://x"}, {"TOXFLEET_MAX_WAIT": "3600"},
                                 {"TOXFLEET_MAX_TEXTS": "0"}])
def test_api_rejects_unsafe_values(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Each unsafe API setting is refused at construction."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError):
        ApiSettings()


def test_checkpoint_identity_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results name a checkpoint by its folder and file, a model by its Detoxify name."""
    ckpt = tmp_path / "mine" / "model.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"x")
    monkeypatch.setenv("TOXFLEET_CHECKPOINT", str(ckpt))
    assert WorkerSettings().model_identity == "checkpoint:mine/model.ckpt"
