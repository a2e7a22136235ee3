"""Settings fail fast on unsafe values, at start, with a message naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import AliasChoices, SecretStr, ValidationError
from pydantic_core import PydanticUndefined

from api.settings import ApiSettings
from testing import ROOT
from worker.settings import WorkerSettings


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


README = ROOT / "README.md"


def _readme_configuration() -> dict[str, str]:
    """README's configuration table as {variable: default cell}; an `A` / `B` row gives each its part."""
    section = README.read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = [n.strip().strip("`") for n in cells[0].split(" / ")]
        defaults = [d.strip().strip("`") for d in cells[1].split(" / ")]
        rows.update(zip(names, defaults if len(defaults) == len(names) else [cells[1]] * len(names), strict=True))
    return rows


@pytest.mark.parametrize("settings", [WorkerSettings, ApiSettings], ids=["worker", "api"])
def test_readme_lists_every_setting_with_its_default(settings: type[WorkerSettings] | type[ApiSettings]) -> None:
    """README's configuration table names every variable each tier reads, with the field's default
    wherever the field has a plain one (None, empty secrets and factories are described in words there)."""
    rows = _readme_configuration()
    for name, field in settings.model_fields.items():
        alias = field.validation_alias
        variable = str(alias.choices[0]) if isinstance(alias, AliasChoices) else f"TOXFLEET_{name.upper()}"
        assert variable in rows, f"README.md's configuration table lacks {variable}"
        default = field.default
        if default is None or default is PydanticUndefined or isinstance(default, SecretStr):
            continue
        if isinstance(default, bool):
            shown = str(default).lower()  # as the environment variable is written
        elif isinstance(default, float) and default.is_integer():
            shown = str(int(default))
        else:
            shown = str(default)
        assert rows[variable] == shown, (variable, rows[variable], shown)
