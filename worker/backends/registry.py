"""The one list of inference backends: each name, how to load it, its precision, what the CPU needs,
and whether the fidelity gate tries it.

Settings validation (`worker.settings`), the loader (`worker.backends.loader`), the gate's candidates
(`worker.gate.fidelity.CANDIDATES`) and the README's backend table (`markdown_table`) all read this
table; nothing else spells a backend's name. Importing it loads no torch, ONNX Runtime or
transformers: loaders and CPU checks are named as `"module:attribute"` and imported when used, so a
tool can render the table and an ONNX-only image can validate its settings.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.backends.base import FP32, REDUCED
from worker.cpus import ARM_INT8_DOT_FLAGS, INT8_DOT_FLAGS, cpu_flags

AUTO = "auto"
"""The setting that lets the gate's decision pick (`worker.gate.selection`); not a backend itself."""

REFERENCE = "torch"
"""The backend every other one is judged against: Detoxify's own model, fp32."""

TORCH = "torch"
"""Runtime of backends built on the model Detoxify loads: they need torch installed."""

ONNX = "onnx"
"""Runtime of backends that load the ahead-of-time export on ONNX Runtime: no torch."""


@dataclass(frozen=True)
class BackendSpec:
    """One backend: what `TOXFLEET_BACKEND=<name>` builds, and how the gate treats it."""

    name: str
    """The TOXFLEET_BACKEND value; a reduced one says its precision in its name (`-int8`, `-bf16`)."""
    precision: str
    """`FP32` or `REDUCED`: which fidelity budget the gate holds it to."""
    runtime: str
    """`TORCH` or `ONNX`: which library the pool process loads."""
    target: str
    """`"module:attribute"`: a `TorchBackend` subclass (torch runtime) or a function (settings) -> Backend
    (ONNX runtime), imported when the backend is built."""
    description: str
    """One line: what runs."""
    needs: str = ""
    """What the machine needs beyond the runtime, in words (the README's table)."""
    unavailable: str | None = None
    """`"module:attribute"` of a function () -> why this backend cannot run on this machine, or None;
    the loader refuses it there and the gate records the reason as a failed row. None: runs anywhere."""
    candidate: bool = True
    """Whether the gate tries it by default (the reference is always measured, as the reference)."""
    gated_on: Callable[[set[str]], bool] | None = None
    """For a candidate: on which CPUs (by their flags, `worker.cpus.cpu_flags`) the gate tries it; None:
    on every CPU. It still loads anywhere when named."""
    gated_where: str = ""
    """`gated_on` in words (the README's table)."""


def int8_dot_products(flags: set[str]) -> bool:
    """Whether a CPU with these flags has int8 dot products (x86 VNNI or AMX, ARM64 `sdot` or `smmla`):
    there ONNX Runtime's u8 x s8 products sum in 32 bits; without them, on x86, pairs of products sum
    in saturating int16 (`vpmaddubsw`)."""
    return not flags.isdisjoint(INT8_DOT_FLAGS + ARM_INT8_DOT_FLAGS)


def no_int8_dot_products(flags: set[str]) -> bool:
    return not int8_dot_products(flags)


def _resolve(reference: str) -> Any:
    """The attribute a `"module:attr.attr"` reference names, importing its module."""
    module, _, attribute = reference.partition(":")
    value: Any = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(REFERENCE, FP32, TORCH, "worker.backends.torch:TorchBackend",
                "exactly the model `detoxify.Detoxify` loads, fp32: the reference", candidate=False),
    BackendSpec("torch-compiled", FP32, TORCH, "worker.backends.compiled:TorchCompiledBackend",
                "the same fp32 model compiled by TorchInductor (compiles for tens of seconds per pool process)",
                needs="a C++ compiler", unavailable="worker.backends.compiled:TorchCompiledBackend.unavailable"),
    BackendSpec("torch-int8", REDUCED, TORCH, "worker.backends.reduced:TorchInt8Backend",
                "torch dynamic int8 quantization of every Linear (per-batch activation scales)"),
    BackendSpec("torch-int8-rowwise", REDUCED, TORCH, "worker.backends.rowwise:TorchRowwiseInt8Backend",
                "per-row int8 activations x per-channel int8 weights (`torch._int_mm`), projections in bf16",
                needs="int8 dot products and bf16 units", unavailable="worker.backends.reduced:rowwise_unavailable"),
    BackendSpec("torch-bf16", REDUCED, TORCH, "worker.backends.reduced:TorchBf16Backend",
                "the model under bf16 autocast, its pooler and classifier in fp32",
                needs="bf16 units", unavailable="worker.backends.reduced:bf16_unavailable"),
    BackendSpec("torch-bf16-compiled", REDUCED, TORCH, "worker.backends.compiled:TorchBf16CompiledBackend",
                "`torch-bf16` compiled by TorchInductor", needs="bf16 units and a C++ compiler",
                unavailable="worker.backends.compiled:TorchBf16CompiledBackend.unavailable"),
    BackendSpec(ONNX, FP32, ONNX, "worker.backends.onnx:load_onnx_fp32",
                "the fp32 graph exported ahead of time, constant-folded and fused, its last layer computed for "
                "the first token alone (the one the head reads), on ONNX Runtime"),
    BackendSpec("onnx-int8", REDUCED, ONNX, "worker.backends.onnx:load_onnx_int8",
                "int8 of that graph by the export's recipe: per-row activations, SmoothQuant, outlier "
                "channels in fp32", gated_on=int8_dot_products,
                gated_where="CPUs with int8 dot products (`avx512_vnni`, `avx_vnni`, `amx_int8`; ARM64 `asimddp`, "
                            "`i8mm`)"),
    BackendSpec("onnx-int8-w7", REDUCED, ONNX, "worker.backends.onnx:load_onnx_int8_w7",
                "`onnx-int8` with 7-bit weights, so that its products cannot saturate where the CPU sums them "
                "in int16", gated_on=no_int8_dot_products, gated_where="CPUs without int8 dot products"),
    BackendSpec("onnx-int8-u8", REDUCED, ONNX, "worker.backends.onnx:load_onnx_int8_u8",
                "`onnx-int8`'s integers with its weights stored as uint8, on ONNX Runtime's slower U8U8 kernels "
                "(exact where the CPU sums int8 products in int16)", gated_on=no_int8_dot_products,
                gated_where="CPUs without int8 dot products"),
)
"""Every backend, the reference first; the gate tries the candidates in this order."""

_BY_NAME = {spec.name: spec for spec in BACKENDS}


def names() -> tuple[str, ...]:
    """Every backend's name, in table order."""
    return tuple(_BY_NAME)


def setting_values() -> tuple[str, ...]:
    """What TOXFLEET_BACKEND accepts: `auto`, then every backend."""
    return (AUTO, *names())


def spec(name: str) -> BackendSpec:
    """Backend `name`'s entry; ValueError (naming what exists) for anything else, `auto` included."""
    found = _BY_NAME.get(name)
    if found is None:
        if name == AUTO:
            raise ValueError("TOXFLEET_BACKEND=auto must be resolved first (worker.gate.selection.resolve_backend)")
        raise ValueError(f"unknown TOXFLEET_BACKEND={name!r}; one of {', '.join(setting_values())}")
    return found


def precision(name: str) -> str:
    """Backend `name`'s precision class (`FP32` or `REDUCED`)."""
    return spec(name).precision


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run on this machine, or None (asked before anything is loaded)."""
    check = spec(name).unavailable
    if check is None:
        return None
    reason: str | None = _resolve(check)()
    return reason


def loader(name: str) -> Callable[..., Any] | type:
    """What builds backend `name`: its `TorchBackend` subclass or its ONNX load function (imported now)."""
    built: Callable[..., Any] | type = _resolve(spec(name).target)
    return built


def candidates(flags: set[str] | None = None) -> tuple[str, ...]:
    """The backends the gate tries by default on a CPU with these flags (default: this one's), in table
    order."""
    have = cpu_flags() if flags is None else flags
    return tuple(s.name for s in BACKENDS if s.candidate and (s.gated_on is None or s.gated_on(have)))


def all_candidates() -> tuple[str, ...]:
    """Every backend the gate may be asked to try, whatever the CPU."""
    return tuple(s.name for s in BACKENDS if s.candidate)


def markdown_table() -> str:
    """The README's backend table, rendered from this registry."""
    lines = ["| backend | precision | runtime | what runs | the CPU needs | gated by `auto` |",
             "|---|---|---|---|---|---|"]
    for s in BACKENDS:
        gated = "reference" if s.name == REFERENCE else ((s.gated_where or "yes") if s.candidate else "no")
        runtime = "torch" if s.runtime == TORCH else "onnxruntime (no torch)"
        lines.append(f"| `{s.name}` | {s.precision} | {runtime} | {s.description} | {s.needs or '-'} | {gated} |")
    lines.append(f"| `{AUTO}` | | | the fastest backend that passed the fidelity gate for this checkpoint on this "
                 f"kind of CPU; `{REFERENCE}` without a valid decision | | |")
    return "\n".join(lines)
