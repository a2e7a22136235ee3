"""Settings fail fast on unsafe values, at start, with a message naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.settings import ApiSettings
from fleet.settings import SharedSettings
from testing import ROOT
from tools import readme
from worker.batching import BatchTask
from worker.settings import WorkerSettings, get_settings


def test_defaults_are_sane(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no environment, both tiers default to a local Redis and the unbiased-small model, and the
    worker to `auto` (the gate's choice, else the torch reference) reading exports next to the checkpoint."""
    for var in ("REDIS_URL", "TOXFLEET_CHECKPOINT", "TOXFLEET_HF_CONFIG", "TOXFLEET_MODEL", "TOXFLEET_BACKEND",
                "TOXFLEET_EXPORT_DIR"):
        monkeypatch.delenv(var, raising=False)
    w, a = WorkerSettings(), ApiSettings()
    assert w.redis_url == a.redis_url == "redis://127.0.0.1:6379/0"
    assert w.model == "unbiased-small" and w.torch_threads == 1
    assert w.backend == "auto" and w.export_dir is None
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
                                 {"TOXFLEET_MAX_TEXTS": "0"}, {"REDIS_URL": "sentinel://s1:26379/0"},
                                 {"TOXFLEET_SUBMIT_MIN_REPLICAS": "1", "TOXFLEET_SUBMIT_REPLICA_TIMEOUT": "1"}])
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


def test_the_tiers_share_one_declaration_of_each_common_field() -> None:
    """A knob both tiers read is declared once, in the shared base, and neither tier redeclares it (so
    that its default and its limits cannot drift apart)."""
    common = set(ApiSettings.model_fields) & set(WorkerSettings.model_fields)
    assert common == set(SharedSettings.model_fields)
    for tier in (ApiSettings, WorkerSettings):
        assert not common & set(tier.__annotations__), tier


def test_batch_budgets_default_from_the_settings_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running task takes its batch budgets from the worker's settings, whose defaults are the only
    ones: the batching layer declares the knobs without a default of its own."""
    for var in ("TOXFLEET_BATCH_TOKENS", "TOXFLEET_BULK_BATCH_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    get_settings.cache_clear()
    from worker.tasks import ScoreTask

    task = ScoreTask()
    fields = WorkerSettings.model_fields
    assert task.batch_tokens == fields["batch_tokens"].default
    assert task.bulk_batch_tokens == fields["bulk_batch_tokens"].default
    assert not hasattr(BatchTask, "batch_tokens") and not hasattr(BatchTask, "bulk_batch_tokens")
    monkeypatch.setenv("TOXFLEET_BATCH_TOKENS", str(fields["batch_tokens"].default + 1))
    get_settings.cache_clear()
    assert ScoreTask().batch_tokens == fields["batch_tokens"].default + 1
    get_settings.cache_clear()


README = ROOT / "README.md"


def test_readme_configuration_is_generated_from_the_settings() -> None:
    """README's generated blocks are what `python -m tools.readme` renders now (the configuration table
    from the settings classes, the benchmark table from docs/benchmarks/notes.md): a field added, a
    default or description changed, or a result updated, without rerunning the tool fails here."""
    assert readme.stale(README.read_text()) == [], "README.md is stale: run python -m tools.readme"


def test_the_generated_table_names_every_variable_once_with_its_default() -> None:
    """Each tier's every field has one row, the shared ones once, with the default as it is written in
    the environment; a block edited by hand is found stale and rendered back."""
    table = readme.config()
    for cls in (ApiSettings, WorkerSettings):
        for name, field in cls.model_fields.items():
            rows = [r for r in table.splitlines() if r.startswith(f"| `{readme.variable(name, field)}` |")]
            assert len(rows) == 1, name
    assert "| `TOXFLEET_BATCH_TOKENS` | 8192 | worker |" in table
    assert "| `TOXFLEET_CACHE` | true | both |" in table and "| `TOXFLEET_THRESHOLDS` | `{}` | api |" in table
    text = README.read_text()
    edited = text.replace("| `TOXFLEET_BATCH_TOKENS` | 8192 |", "| `TOXFLEET_BATCH_TOKENS` | 2048 |")
    assert edited != text and readme.stale(edited) == ["config"]
    assert readme.render(edited) == text
    assert readme.benchmarks().splitlines()[0].startswith("| CPU |")
    assert readme.stale(text.replace(readme.backends(), "| stale |\n")) == ["backends"]
