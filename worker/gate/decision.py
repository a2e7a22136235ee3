"""The gate's verdict for one checkpoint on one kind of CPU, as `decision.json` in its export directory.

`python -m worker.export` (or `python -m worker.gate --write-decision`) writes it: the gate's table
and the fastest backend that passed. It holds only while what runs now is what was measured: the same
checkpoint, the same int8 recipe, the same kernel-relevant CPU flags, the same torch/onnxruntime/transformers
versions.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.cpus import cpu_model_name, kernel_signature
from worker.onnx_export.artifacts import DECISION_FILE, EXPORT_FORMAT, installed_version, int8_records

DECISION_FORMAT = 4
"""Version of decision.json; another version is ignored (auto falls back to the reference). 2: the
current budgets (p99, flips at every threshold, rank agreement); a format-1 decision was judged on
looser ones, so it must be made again. 3: records the int8 recipe whose graph the gate measured
(`int8_recipe`); a format-2 decision cannot say which it was. 4: records the export format whose graphs
it measured (`export_format`)."""

DECIDING_VERSIONS = ("torch", "onnxruntime", "transformers")
"""Packages whose version changes the kernels or the tokenizer the gate measured."""


@dataclass
class Decision:
    """The gate's verdict for one checkpoint on one kind of CPU."""

    checkpoint_sha256: str
    chosen: str
    rows: list[dict[str, Any]]
    threads: int
    texts: int
    kernel_signature: str = field(default_factory=kernel_signature)
    cpu: str = field(default_factory=cpu_model_name)
    versions: dict[str, str | None] = field(
        default_factory=lambda: {d: installed_version(d) for d in DECIDING_VERSIONS})
    int8_recipe: dict[str, Any] = field(default_factory=int8_records)
    """The recipe of each int8 graph gated, by file: another recipe's graph scores and times differently, so
    the choice among all backends must be made again (bf16 may have won only because int8 failed)."""
    export_format: int = EXPORT_FORMAT
    """The export format (`artifacts.EXPORT_FORMAT`) of the graphs gated: another format's graphs compute
    differently."""
    format: int = DECISION_FORMAT
    created: float = field(default_factory=time.time)

    def write(self, directory: Path) -> Path:
        return self.write_file(directory / DECISION_FILE)

    def write_file(self, path: Path) -> Path:
        """Write it to `path` at once (through a temporary file beside it)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, directory: Path) -> Decision:
        return cls.read_file(directory / DECISION_FILE)

    @classmethod
    def read_file(cls, path: Path) -> Decision:
        return cls(**json.loads(path.read_text()))

    def invalid_because(self, checkpoint_sha: str) -> str | None:
        """Why this decision does not hold for what runs now, or None if it does."""
        if self.format != DECISION_FORMAT:
            return f"decision format {self.format}, expected {DECISION_FORMAT}"
        if self.checkpoint_sha256 != checkpoint_sha:
            return "decision was made for another checkpoint"
        if self.export_format != EXPORT_FORMAT:
            return (f"decision was made on export format {self.export_format}'s graphs, this worker reads "
                    f"{EXPORT_FORMAT}")
        if self.int8_recipe != int8_records():
            return "decision was made on another int8 recipe's graph (the export's recipe changed since)"
        signature = kernel_signature()
        if self.kernel_signature != signature:
            return f"decision was made on a CPU with [{self.kernel_signature}], this one has [{signature}]"
        for dist in DECIDING_VERSIONS:
            have, made = installed_version(dist), self.versions.get(dist)
            # A package absent now (torch in an ONNX-only image) matters only if the choice needs it.
            if have is not None and have != made:
                return f"decision was made with {dist} {made}, this worker has {have}"
        if self.chosen.startswith("torch") and installed_version("torch") is None:
            return f"decision chose {self.chosen} but torch is not installed"
        return None
