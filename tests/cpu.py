"""What this CPU cannot check, as pytest markers (a skip names the measured reason)."""

from __future__ import annotations

import pytest

from worker.backends import reduced
from worker.backends.reduced import int8_dot_unavailable

_INT8_DOT = int8_dot_unavailable()

needs_exact_int8 = pytest.mark.skipif(
    _INT8_DOT is not None,
    reason="ONNX Runtime's uint8 x int8 MatMulInteger sums products in saturating int16 on CPUs without "
           f"int8 dot products, so exact int8 results cannot be checked here ({_INT8_DOT}); the gate still "
           "judges onnx-int8 on such a CPU")
"""For tests that hold ONNX Runtime's int8 results to exact int32 arithmetic."""


def lift_speed_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test-only: let the bf16 torch backends load on a CPU without bf16 units, for the calling test.
    Their refusal there (`reduced.bf16_unavailable`) is about speed only: PyTorch and oneDNN emulate
    bf16 on any x86-64 CPU, tens of times slower than fp32 but to the same results (on the tiny
    checkpoint, oneDNN held to AVX2 gave the gate figures of native avx512_bf16 to 1e-3), and the
    tiny checkpoint takes seconds. So their numerics are checked on every CPU, an AVX2-only CI machine
    included. The int8 refusal (`reduced.int8_dot_unavailable`) stays: without int8 dot products
    oneDNN's int8 matmul saturates (`torch._int_mm` held to AVX2: int32 products off by up to 74,879),
    so a backend built on it computes wrong results there, not just slow ones."""
    monkeypatch.setattr(reduced, "bf16_unavailable", lambda: None)
