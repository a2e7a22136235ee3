"""The synthetic checkpoints the tests and the benchmark score with (random weights, real architectures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testing.processes import ROOT

MODELS = Path(os.environ.get("TOXFLEET_TEST_MODELS", ROOT / "models"))


def synthetic_checkpoint(kind: str) -> tuple[Path, Path]:
    """(model.ckpt, hf/) of a synthetic checkpoint under MODELS (`make test` builds them; built here if missing)."""
    ckpt = MODELS / kind / "model.ckpt"
    if not ckpt.is_file():
        subprocess.run([sys.executable, "-m", "tools.synthetic", kind, "--out", str(MODELS)], check=True, cwd=ROOT)
    return ckpt, ckpt.parent / "hf"
