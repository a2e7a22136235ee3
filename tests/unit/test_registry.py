"""The backend registry is the one list: settings, the gate, the loader and the README table read it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from worker.backends import loader, registry
from worker.backends.base import FP32, REDUCED
from worker.gate import fidelity
from worker.settings import WorkerSettings


def test_settings_accept_exactly_auto_and_the_registry() -> None:
    """Every registry name validates, `auto` too, and nothing else; the field's description lists them all."""
    for name in registry.setting_values():
        assert WorkerSettings(backend=name).backend == name
    with pytest.raises(ValidationError, match="onnx-int9"):
        WorkerSettings(backend="onnx-int9")
    description = WorkerSettings.model_fields["backend"].description or ""
    assert all(f"`{name}`" in description for name in registry.setting_values())


def test_gate_candidates_and_precisions_come_from_the_registry() -> None:
    """The gate tries the registry's candidates (never the reference as a candidate), and judges each
    by the registry's precision."""
    assert registry.candidates() == fidelity.CANDIDATES
    assert registry.REFERENCE not in fidelity.CANDIDATES
    assert set(fidelity.CANDIDATES) <= set(registry.names())
    for spec in registry.BACKENDS:
        assert fidelity.precision_of(spec.name) == spec.precision in (FP32, REDUCED)


def test_reduced_names_say_their_precision() -> None:
    """Operators read the name in /readyz: a reduced backend's name carries `-int8` or `-bf16`."""
    for spec in registry.BACKENDS:
        assert (spec.precision == REDUCED) == any(tag in spec.name for tag in ("-int8", "-bf16")), spec.name


def test_every_loader_and_cpu_check_resolves() -> None:
    """Each entry's loader reference names a class or function that exists, and each CPU check answers
    a reason or None; an unknown name or `auto` is refused by the loader with a ValueError."""
    for spec in registry.BACKENDS:
        assert callable(registry.loader(spec.name)), spec.name
        reason = loader.unavailable(spec.name)
        assert reason is None or isinstance(reason, str)
    with pytest.raises(ValueError, match="resolved first"):
        registry.spec(registry.AUTO)
    with pytest.raises(ValueError, match="unknown TOXFLEET_BACKEND"):
        registry.spec("tensorflow")


def test_importing_the_registry_and_settings_loads_no_runtime() -> None:
    """Tools render the table, and the main process validates settings, without torch or ONNX Runtime."""
    code = ("import sys; import worker.settings, worker.backends.registry as r; r.markdown_table(); "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_markdown_table_has_one_row_per_backend_and_auto() -> None:
    table = registry.markdown_table().splitlines()
    rows = [line.split("|")[1].strip().strip("`") for line in table[2:]]
    assert rows == [*registry.names(), registry.AUTO]
