"""How many processes a container's CPUs support: cgroup quota and SMT siblings, and which backends its
flags rule out (pure logic on files and flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.backends import loader, reduced, registry
from worker.cpus import (
    cgroup_cpu_limit,
    cpu_flags,
    cpu_model_name,
    default_concurrency,
    kernel_signature,
    physical_cores,
)


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


GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
"""/proc/cpuinfo of an AWS Graviton2 (Neoverse N1), first CPU: int8 dot products, no i8mm, bf16 or SVE."""

GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""
"""/proc/cpuinfo of an AWS Graviton3 (Neoverse V1), first CPU."""

ARM_NO_DOT = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\nCPU part\t: 0xd08\n"
"""/proc/cpuinfo of a Cortex-A72 (Graviton1 kind): no int8 dot products."""

AVX2_ONLY = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz\n"
             "flags\t\t: fpu sse2 avx avx2 fma\n")
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl\n"
CASCADE_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"


def _flags(tmp_path: Path, text: str) -> set[str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    return cpu_flags(cpuinfo)


def test_arm_signature_tells_graviton2_from_graviton3(tmp_path: Path) -> None:
    """ARM64's `Features` line is read like x86's `flags`: a Graviton3 decision (dot products, i8mm, bf16,
    SVE) never matches a Graviton2 (dot products only), nor a CPU without dot products."""
    g2, g3, a72 = (kernel_signature(_flags(tmp_path, t)) for t in (GRAVITON2, GRAVITON3, ARM_NO_DOT))
    assert g2 == "asimddp"
    assert g3 == "asimddp,i8mm,bf16,sve"
    assert a72 == "baseline"
    assert len({g2, g3, a72}) == 3


def test_x86_signatures_are_unchanged_by_the_arm_flags(tmp_path: Path) -> None:
    """Adding ARM flags to the signature changes no x86 signature, so no x86 decision is invalidated."""
    assert kernel_signature(_flags(tmp_path, AVX2_ONLY)) == "avx2"
    assert kernel_signature(_flags(tmp_path, CASCADE_LAKE)) == "avx2,avx512f,avx512_vnni"


def test_arm_model_names_its_part(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(GRAVITON3)
    assert "0xd40" in cpu_model_name(cpuinfo) and "Graviton3" in cpu_model_name(cpuinfo)
    cpuinfo.write_text(AVX2_ONLY)
    assert cpu_model_name(cpuinfo).startswith("Intel(R) Xeon(R) CPU E5-2686 v4")


@pytest.mark.parametrize(("cpuinfo", "int8"), [
    (AVX2_ONLY, "onnx-int8-w7"), (SKYLAKE, "onnx-int8-w7"), (CASCADE_LAKE, "onnx-int8"),
    (GRAVITON2, "onnx-int8"), (GRAVITON3, "onnx-int8"), (ARM_NO_DOT, "onnx-int8-w7"),
])
def test_the_gate_tries_onnx_int8_graphs_that_cannot_saturate(tmp_path: Path, cpuinfo: str, int8: str) -> None:
    """Where the CPU has int8 dot products (x86 VNNI/AMX, ARM64 `asimddp`/`i8mm`), the gate tries
    `onnx-int8`; elsewhere its products could saturate, and it tries instead `onnx-int8-w7` (7-bit
    weights, the same kernel) and `onnx-int8-u8` (the same integers on the U8U8 kernels)."""
    candidates = registry.candidates(_flags(tmp_path, cpuinfo))
    expected = [int8] if int8 == "onnx-int8" else ["onnx-int8-w7", "onnx-int8-u8"]
    assert [name for name in candidates if name.startswith("onnx-int8")] == expected
    assert "onnx" in candidates
