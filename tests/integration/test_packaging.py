"""A plain `pip install .` (no extras) is the Python client and the `toxfleet` CLI, and nothing heavier:
one top-level package, every module of which imports with httpx alone.

Installed into a brand-new virtual environment, from this checkout, with pip as a user runs it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from testing import ROOT

HEAVY = ("celery", "kombu", "redis", "pydantic", "pydantic_settings", "fastapi", "torch", "transformers",
         "detoxify")

PROBE = f"""
import importlib, importlib.metadata, importlib.util, pkgutil, sys
import toxfleet
from toxfleet.client import AsyncClient, Client, JobFailed
modules = [m.name for m in pkgutil.walk_packages(toxfleet.__path__, "toxfleet.")]
for name in modules:
    importlib.import_module(name)
files = importlib.metadata.distribution("toxfleet").files or []
tops = sorted({{f.parts[0] for f in files if f.suffix == ".py" or len(f.parts) > 1}}
              - {{p for p in {{f.parts[0] for f in files}} if p.endswith((".dist-info", ".data")) or p == ".."}})
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
installed = sorted(m for m in {HEAVY!r} if importlib.util.find_spec(m) is not None)
print("modules", len(modules), "top-level", tops, "loaded", loaded, "installed", installed)
sys.exit(1 if loaded or installed or tops != ["toxfleet"] or "toxfleet.cli.main" not in modules else 0)
"""


@pytest.mark.slow
def test_plain_install_is_client_and_cli_only(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # A copy of the sources, so that the build's scratch files (build/, *.egg-info) stay out of the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "models", "var", "build",
                                                             "*.egg-info", "__pycache__", ".*_cache"))
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    help_text = subprocess.run([str(env_dir / "bin" / "toxfleet"), "score", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=tmp_path)
    assert help_text.returncode == 0 and "--local" in help_text.stdout, help_text.stderr
    assert sys.prefix not in probe.stdout  # the probe ran in the new environment, not this one
