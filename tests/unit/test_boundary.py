"""The API tier must stay light: importing it never loads torch, transformers, detoxify or worker code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ["torch", "transformers", "detoxify", "worker", "onnxruntime", "tokenizers", "numpy"]


def _loaded_after(statement: str) -> list[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    modules: list[str] = json.loads(out.strip().splitlines()[-1])
    return [m for m in modules if m.split(".")[0] in HEAVY]


@pytest.mark.parametrize("statement", ["import api", "import api.main",
                                       "from api.main import create_app; create_app()"])
def test_api_import_loads_no_model_code(statement: str) -> None:
    """A fresh interpreter that imports the API has none of the heavy modules in sys.modules."""
    assert _loaded_after(statement) == []


def test_contract_is_stdlib_only() -> None:
    """The contract shared by both tiers imports nothing outside the standard library."""
    code = ("import sys; before = set(sys.modules); import toxfleet.contract; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names) - {'toxfleet'}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_worker_import_does_not_load_the_model() -> None:
    """Importing the worker's Celery app and task (what `celery -A worker` does) loads no torch."""
    assert [m for m in _loaded_after("import worker; worker.app; import worker.tasks") if m.split(".")[0] in
            ("torch", "transformers", "detoxify")] == []


@pytest.mark.parametrize("statement", [
    "import toxfleet.client", "import toxfleet.cli.main", "import fleet.cache", "import toxfleet.thresholds",
    "from toxfleet.cli.main import build_parser; build_parser().parse_args(['score', 'x'])"])
def test_client_side_loads_no_model_code(statement: str) -> None:
    """The client, the CLI (unless --local) and the cache need neither torch nor worker code."""
    assert _loaded_after(statement) == []


def test_thresholds_are_stdlib_only() -> None:
    """Thresholds are pure logic: importing them pulls in nothing outside the standard library."""
    code = ("import sys; before = set(sys.modules); import toxfleet.thresholds; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names) - {'toxfleet'}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
