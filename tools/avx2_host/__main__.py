"""Run a command as if on an x86 CPU with AVX2 and no AVX-512, VNNI, bf16 or AMX.

A stand-in for the AVX2-only hosts Fargate may give (docs/int8-recipes.md) on a newer x86 CPU: the
command and its children see that CPU in CPUID (`cpuid_mask.c`, LD_PRELOAD'ed) and in /proc/cpuinfo
(a copy without those flags, bind-mounted in a private mount namespace), so the libraries run their
AVX2 kernels natively and the worker's kernel signature and gate candidates are the AVX2 host's. The
cores stay this machine's: speeds are this CPU's AVX2 speeds, not an older CPU's. Needs Linux, root
(`unshare --mount`), gcc and the CPU's `cpuid_fault` flag.

    python -m tools.avx2_host --check
    python -m tools.avx2_host -- python -m bench.run --models trained:auto
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cpuid_mask.c"
CACHE = HERE.parents[1] / "var" / "avx2_host"

MASKED_FLAGS = ("avx512", "amx_", "avx_vnni", "avx_ifma", "avx_ne_convert")
"""/proc/cpuinfo flags (by prefix) that the shim also clears from CPUID."""

CHECK = """
import numpy as np, onnxruntime as ort, torch
from onnx import TensorProto, helper
from worker.cpus import kernel_signature
K = 64
graph = helper.make_graph(
    [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "sat",
    [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, K])],
    [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
    [helper.make_tensor("w", TensorProto.INT8, [K, 1], np.full((K, 1), 127, np.int8).tobytes(), raw=True)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
got = int(session.run(None, {"a": np.full((1, K), 255, np.uint8)})[0][0, 0])
exact = K * 255 * 127
print(f"kernel signature: {kernel_signature()}")
print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
print(f"ONNX Runtime u8 x s8 (255 x 127, K={K}): {got} against exact {exact}:",
      "saturating int16 pairs (vpmaddubsw, no VNNI)" if got < exact else "exact (int8 dot products)")
"""
"""What `--check` runs inside: the signature the worker computes, the ISA ATen dispatches to, and
whether ONNX Runtime's int8 GEMM saturates, as it does only without int8 dot products."""


def shim() -> Path:
    """The compiled shim, rebuilt when its source changes."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    built = CACHE / f"cpuid_mask-{digest}.so"
    if not built.exists():  # built aside and renamed: concurrent callers never load a half-written file
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = built.with_name(f"{built.name}.{os.getpid()}")
        subprocess.run(["gcc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"], check=True)
        os.replace(partial, built)
    return built


def masked_cpuinfo(source: Path = Path("/proc/cpuinfo")) -> Path:
    """A copy of /proc/cpuinfo whose `flags` lines lack `MASKED_FLAGS`."""
    lines = []
    for line in source.read_text().splitlines():
        if line.startswith("flags"):
            key, _, flags = line.partition(":")
            flags = " ".join(f for f in flags.split() if not f.startswith(MASKED_FLAGS))
            line = f"{key}: {flags}"
        lines.append(line)
    CACHE.mkdir(parents=True, exist_ok=True)
    copy, partial = CACHE / "cpuinfo", CACHE / f"cpuinfo.{os.getpid()}"
    partial.write_text("\n".join(lines) + "\n")
    os.replace(partial, copy)  # whole, for a concurrent caller's bind mount
    return copy


def unavailable() -> str | None:
    """Why the stand-in cannot run here, or None."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "it needs Linux on x86_64"
    if "cpuid_fault" not in Path("/proc/cpuinfo").read_text():
        return "this CPU (or its hypervisor) has no cpuid_fault flag, so CPUID cannot be masked"
    if os.geteuid() != 0:
        return "it needs root, to bind-mount /proc/cpuinfo in a mount namespace of its own"
    missing = [tool for tool in ("gcc", "unshare", "mount") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def command(argv: list[str]) -> list[str]:
    """`argv` wrapped to run in a private mount namespace with the masked cpuinfo and the shim."""
    why = unavailable()
    if why:
        raise SystemExit(f"avx2_host: {why}")
    inner = (f"mount --bind {shlex.quote(str(masked_cpuinfo()))} /proc/cpuinfo && "
             f"LD_PRELOAD={shlex.quote(str(shim()))} exec {shlex.join(argv)}")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", inner]


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.avx2_host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="show what the masked CPU looks like to the libraries")
    parser.add_argument("argv", nargs="*", help="the command to run (after --)")
    options = parser.parse_args(args)
    argv = [sys.executable, "-c", CHECK] if options.check else options.argv
    if not argv:
        parser.error("give --check or a command after --")
    code = subprocess.run(command(argv), env=os.environ).returncode
    if code < 0:  # end as the command did, by its signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
