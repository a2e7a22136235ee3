"""How many worker processes the container's CPUs can keep busy.

Inference here is compute-bound, and SMT siblings share one core's vector units, so the default is
one process per *physical* core the container may run on, further capped by its cgroup CPU quota
(Fargate and Docker `--cpus` set a quota, not an affinity mask, so `os.cpu_count()` overstates them).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup quota (v2 `cpu.max` or v1 `cfs_quota_us`), or None if unlimited."""
    v2 = root / "cpu.max"
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def physical_cores(cpus: set[int], sys_cpu: Path = _SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus`; falls back to `len(cpus)` without topology."""
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def default_concurrency(threads_per_process: int = 1) -> int:
    """Processes to run: physical cores we may use, capped by the quota, divided by threads each."""
    allowed = os.sched_getaffinity(0)
    cores = physical_cores(allowed)
    limit = cgroup_cpu_limit()
    if limit is not None:
        # A quota of 4 vCPU on SMT hardware is about 2 cores of compute.
        smt = max(1, len(allowed) // max(1, cores))
        cores = min(cores, max(1, math.floor(limit / smt + 1e-9)))
    return max(1, cores // threads_per_process)


KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16",
                "asimddp", "i8mm", "bf16", "sve", "sve2")
"""CPU flags that change which kernels ONNX Runtime, oneDNN and fbgemm pick, and so change both the
speed and the exact rounding of reduced-precision backends (e.g. int8 without VNNI saturates). The x86
ones come from /proc/cpuinfo's `flags`; the ARM64 ones from its `Features`: int8 dot products
(`asimddp`), int8 matrix multiply (`i8mm`), bf16 (`bf16`) and SVE, which tell e.g. a Graviton2 (dot
products only) from a Graviton3 (all of them)."""

INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
"""x86 flags that give int8 matrix units (AMX) or dot-product instructions (VNNI). Without one,
`torch._int_mm` falls back to kernels ~50x slower than fp32, and ONNX Runtime's uint8 x int8 products
sum pairs in saturating int16 (`vpmaddubsw`), wrong once a pair exceeds 32,767 (docs/int8-recipes.md)."""


ARM_INT8_DOT_FLAGS = ("asimddp", "i8mm")
"""ARM64 flags that give int8 dot products (`sdot`/`udot`) or int8 matrix multiplies (`smmla`):
ONNX Runtime's int8 kernels there sum in 32 bits, so nothing saturates."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo: x86's `flags` line or ARM64's `Features` line
    (empty where there is none, e.g. macOS)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_signature(flags: set[str] | None = None) -> str:
    """The kernel-relevant flags this CPU has, as one stable string: the key a fidelity decision is
    valid for (`worker.gate.decision`)."""
    have = cpu_flags() if flags is None else flags
    return ",".join(flag for flag in KERNEL_FLAGS if flag in have) or "baseline"


ARM_PARTS = {"0xd0c": "Neoverse N1 (e.g. Graviton2)", "0xd40": "Neoverse V1 (e.g. Graviton3)",
             "0xd4f": "Neoverse V2 (e.g. Graviton4)", "0xd49": "Neoverse N2"}
"""ARM64 /proc/cpuinfo `CPU part` numbers (implementer 0x41, Arm) named in reports; others print as numbers."""


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, for reports only (ARM64, which has no `model name`: its implementer and part)."""
    try:
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            return fields["model name"]
        if "CPU part" in fields:
            part, maker = fields["CPU part"], fields.get("CPU implementer", "?")
            return f"ARM64 implementer {maker} part {part} {ARM_PARTS.get(part, '')}".strip()
    except OSError:
        pass
    return "unknown"
