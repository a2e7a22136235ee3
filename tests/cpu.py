"""What this CPU cannot check, as pytest markers (a skip names the measured reason)."""

from __future__ import annotations

import pytest

from worker.backends.reduced import int8_dot_unavailable

_INT8_DOT = int8_dot_unavailable()

needs_exact_int8 = pytest.mark.skipif(
    _INT8_DOT is not None,
    reason="ONNX Runtime's uint8 x int8 MatMulInteger sums products in saturating int16 on CPUs without "
           f"int8 dot products, so exact int8 results cannot be checked here ({_INT8_DOT}); the gate still "
           "judges onnx-int8 on such a CPU")
"""For tests that hold ONNX Runtime's int8 results to exact int32 arithmetic."""
