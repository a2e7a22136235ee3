"""How many processes a container's CPUs support: cgroup quota and SMT siblings, and which backends its
flags rule out (pure logic on files and flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.backends import loader, reduced
from worker.cpus import cgroup_cpu_limit, default_concurrency, physical_cores


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    """`cpu.max` of 200000/100000 means 2 CPUs; `max` means no limit."""
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.0
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    """cgroup v1 quota/period is read too; -1 means no limit."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_limit(tmp_path) is None


def test_smt_siblings_count_once(tmp_path: Path) -> None:
    """Four logical CPUs on two cores (SMT) count as two physical cores."""
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0")
        (topo / "core_id").write_text(str(core))
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2


def test_default_concurrency_is_positive() -> None:
    """On whatever machine runs the tests, the default is at least one process."""
    assert default_concurrency() >= 1
    assert default_concurrency(threads_per_process=64) == 1


def test_reduced_backends_are_refused_on_cpus_that_would_emulate_their_arithmetic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 needs bf16 units; the per-row int8 backend needs int8 dot products and, for the projections
    its plan keeps in bf16, bf16 units: without them each runs ~50x slower than fp32 (reduced.py)."""
    monkeypatch.setattr(reduced, "cpu_flags", lambda: {"avx2", "fma"})
    assert "avx512_bf16" in (reduced.bf16_unavailable() or "")
    assert "avx512_vnni" in (loader.unavailable("torch-int8-rowwise") or "")
    assert loader.unavailable("torch-int8") is None  # fbgemm has AVX2 kernels
    monkeypatch.setattr(reduced, "cpu_flags", lambda: {"avx2", "avx512_vnni"})
    assert "avx512_bf16" in (loader.unavailable("torch-int8-rowwise") or "")
    monkeypatch.setattr(reduced, "cpu_flags", lambda: {"avx512_vnni", "avx512_bf16"})
    assert loader.unavailable("torch-int8-rowwise") is None and loader.unavailable("torch-bf16") is None
