"""What a model needs before a benchmark measures it: its checkpoint (built if missing) and what its
toxfleet backend loads (prepared as `make run` prepares it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench.services import ROOT
from worker.gate.selection import resolve_backend
from worker.settings import WorkerSettings

TRAINED = "trained"
"""The checkpoint kind `tools.trained` builds (real MiniLM weights, fine-tuned); the others are synthetic."""


def ensure_checkpoint(models_dir: Path, kind: str, log: Callable[[str], None]) -> tuple[Path, Path]:
    ckpt = models_dir / kind / "model.ckpt"
    if not ckpt.is_file():
        tool = ["tools.trained"] if kind == TRAINED else ["tools.synthetic", kind]
        log(f"building checkpoint {kind} in {models_dir} ({' '.join(tool)})")
        subprocess.run([sys.executable, "-m", *tool, "--out", str(models_dir)], check=True, cwd=ROOT)
    return ckpt, ckpt.parent / "hf"


def prepare_backend(ckpt: Path, hf: Path, backend: str, log: Callable[[str], None]) -> dict[str, str]:
    """What `make run` does before its workers start (`python -m worker.export --prepare`): the export a
    forced ONNX backend loads, or for `auto` the export and the fidelity gate's decision (cached by the
    checkpoint's sha256). Returns the backend asked for, the one the workers will run and why."""
    env = {"TOXFLEET_CHECKPOINT": str(ckpt), "TOXFLEET_HF_CONFIG": str(hf), "TOXFLEET_BACKEND": backend}
    if backend != "torch":
        log(f"preparing TOXFLEET_BACKEND={backend} for {ckpt}")
        subprocess.run([sys.executable, "-m", "worker.export", "--prepare"], check=True, cwd=ROOT,
                       env={**os.environ, **env})
    runs, why = resolve_backend(WorkerSettings(checkpoint=ckpt, hf_config=hf, backend=backend))
    log(f"toxfleet runs {runs} ({why})")
    return {"asked": backend, "runs": runs, "why": why}
