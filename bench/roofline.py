"""The two sides of the roofline: what the model costs per text, and what the CPU can do at most.

Model cost, per encoder layer and per sequence of T tokens (d = hidden size, f = feed-forward size):
the four d x d projections and the two d x f matmuls cost 2 FLOP per weight per token, and attention
scores plus the weighted sum cost 4 d T^2. ALBERT shares one layer's weights across its 12 layers
but still runs 12 layers, so its compute equals BERT-base's: about 170 MFLOP per token. ALBERT's
128 -> 768 embedding projection is counted; embeddings lookups, layer norms, softmax and the
classifier are not (well under 1 %).

CPU peak (fp32): cores x FMA units x vector lanes x 2 (multiply + add) x clock. The clock is the one
/proc/cpuinfo reports (a virtual machine shows the nominal clock, not turbo or the lower AVX-512
licence clock), and the FMA-unit count cannot be read from Linux at all: both are assumptions the
report states, and both can be overridden.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from worker.cpus import default_concurrency

DEFAULT_FMA_UNITS = 2
"""FMA units per core assumed: 2 on Xeon Scalable Gold 6xxx/Platinum and later with AVX-512 (a
Xeon Gold 5xxx or Silver has 1, which halves the peak)."""


@dataclass(frozen=True)
class Architecture:
    layers: int
    hidden: int
    intermediate: int
    embedding: int | None  # ALBERT's factorised embedding size; None for BERT

    @classmethod
    def from_hf_config(cls, hf_dir: Path) -> Architecture:
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        embedding = cfg.get("embedding_size")
        hidden = int(cfg["hidden_size"])
        return cls(int(cfg["num_hidden_layers"]), hidden, int(cfg["intermediate_size"]),
                   int(embedding) if embedding is not None and embedding != hidden else None)

    def flops(self, tokens: int) -> float:
        """Forward-pass FLOPs of one sequence of `tokens` tokens."""
        d, f, t = self.hidden, self.intermediate, tokens
        per_layer = 2 * (4 * d * d + 2 * d * f) * t + 4 * d * t * t
        projection = 2 * self.embedding * d * t if self.embedding else 0
        return float(self.layers * per_layer + projection)

    def flops_per_token(self) -> float:
        """FLOPs per token of the matmuls alone (attention's T^2 term excluded)."""
        return self.flops(1) - 4 * self.hidden * self.layers

    def pass_flops(self, lengths: list[int]) -> tuple[float, float]:
        """(useful, executed) FLOPs of one padded forward pass over sequences of these lengths:
        useful counts each text's own tokens, executed counts every text at the pass's longest."""
        if not lengths:
            return 0.0, 0.0
        longest = max(lengths)
        return sum(self.flops(n) for n in lengths), len(lengths) * self.flops(longest)


@dataclass(frozen=True)
class CpuPeak:
    model: str
    cores: int
    clock_ghz: float
    vector_bits: int
    fma_units: int
    gflops: float
    assumptions: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _cpuinfo() -> tuple[str, float | None, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", None, set()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else "unknown", float(mhz.group(1)) if mhz else None,
            set(flags.group(1).split()) if flags else set())


def cpu_peak(cores: int, clock_ghz: float | None = None, fma_units: int = DEFAULT_FMA_UNITS) -> CpuPeak:
    """Peak fp32 FLOP/s of `cores` cores of this machine's CPU, with the assumptions spelled out."""
    model, mhz, flags = _cpuinfo()
    vector_bits = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
    clock_source = "given"
    if clock_ghz is None:
        clock_ghz = (mhz or 2000.0) / 1000
        clock_source = "/proc/cpuinfo 'cpu MHz'" if mhz else "unknown, 2.0 GHz assumed"
    lanes = vector_bits // 32
    gflops = cores * fma_units * lanes * 2 * clock_ghz
    assumptions = (f"{cores} cores x {fma_units} FMA units x {lanes} fp32 lanes ({vector_bits}-bit) x 2 FLOP "
                   f"x {clock_ghz:.2f} GHz (clock: {clock_source}; FMA units assumed, not readable from Linux; "
                   f"sustained AVX-512 clocks may be lower and turbo higher)")
    return CpuPeak(model, cores, clock_ghz, vector_bits, fma_units, gflops, assumptions)


def usable_cores() -> int:
    """Physical cores this process may use, as the worker counts them (quota and SMT aware)."""
    return default_concurrency(1) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
