"""How many processes a container's CPUs support: cgroup quota and SMT siblings (pure logic on files)."""

from __future__ import annotations

from pathlib import Path

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
