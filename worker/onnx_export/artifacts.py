"""Ahead-of-time ONNX exports as a worker reads them: where they live, what their manifest says, and
whether they may be used.

Workers never export: they load what `python -m worker.export` built (`worker.onnx_export.build`), and
refuse an export that is missing, stale (another export format, checkpoint, onnxruntime or
transformers version) or corrupt (a file whose sha256 differs from the manifest) with one line naming
the command to run. Nothing here imports torch or ONNX Runtime.

Layout, next to the checkpoint unless TOXFLEET_EXPORT_DIR says otherwise:

    exports/<checkpoint sha256>/manifest.json    hashes, versions, opset, labels, int8 recipe
                               model.onnx        fp32, constant-folded, transformer ops fused
                               model-int8.onnx   int8 of model.onnx by the recorded `Int8Recipe` (default:
                                                 per-row int8 products + SmoothQuant, `worker.onnx_export.int8_graph`)
                               model-int8-w7.onnx  the same recipe with 7-bit weights (`seven_bit_weights`),
                                                 for CPUs without int8 dot products
                               model-int8-u8.onnx  model-int8.onnx's weights stored as uint8, for ONNX
                                                 Runtime's U8U8 kernels (`rowwise.unsigned_weights`)
                               tokenizer/        Detoxify's tokenizer, saved, so no hub and no torch at run time
                               decision.json     the fidelity gate's table and the backend `auto` picks
                               reference.json    the torch reference's scores of the gate corpus (any CPU's
                                                 gate reuses them: `worker.gate.reference`)
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from worker.settings import WorkerSettings
from worker.weights import DETOXIFY_URLS, torch_hub_checkpoint

EXPORT_FORMAT = 3
"""Version of this layout and recipe; an export of another format is stale. 2: adds `INT8_W7_MODEL` and
`INT8_U8_MODEL`. 3: the graphs compute the last layer for the first token only (`first_token`)."""

MANIFEST_FILE = "manifest.json"
FP32_MODEL = "model.onnx"
INT8_MODEL = "model-int8.onnx"
INT8_W7_MODEL = "model-int8-w7.onnx"
INT8_U8_MODEL = "model-int8-u8.onnx"
TOKENIZER_DIR = "tokenizer"
DECISION_FILE = "decision.json"
REFERENCE_FILE = "reference.json"

RUNTIME_PINNED = ("onnxruntime", "transformers")
"""Packages a worker must run at the exported version: onnxruntime produced the fused and quantized
graphs and its kernels are what the gate measured; transformers saved and loads the tokenizer."""

REBUILD_HINT = "run `python -m worker.export` with the same TOXFLEET_* settings to rebuild it"


class ExportError(RuntimeError):
    """An export a worker must not use; the message says why and what to run."""


PER_ROW = "per-row"
"""Int8 activations with one scale per token (`worker.onnx_export.int8_graph`): int8 products, per-row scales."""

PER_TENSOR = "per-tensor"
"""Int8 activations with one scale per tensor per call (`onnxruntime.quantization.quantize_dynamic`)."""


@dataclass(frozen=True)
class Int8Recipe:
    """How `model-int8.onnx` is quantized; the manifest records it, and a worker refuses an int8 graph
    built by another recipe (`verify_int8_recipe`).

    The default is per-row activations with SmoothQuant, uint8 GELU rows and 32 outlier channels in
    fp32 (`worker.onnx_export.int8_graph`): the int8 recipe measured closest to fp32 on the trained checkpoint.
    ONNX Runtime's per-tensor dynamic quantization is several times further off there, because one text's outlier
    token sets the scale of every text padded beside it (docs/history.md, the int8 recipes). The gate decides.
    """

    activations: str = PER_ROW
    """`PER_ROW` (our per-row int8 graph) or `PER_TENSOR` (ONNX Runtime's dynamic quantizer)."""
    smooth_alpha: float | None = 0.5
    """SmoothQuant migration strength (per-row only); None: no smoothing, no calibration."""
    calibration_texts: int = 128
    """SmoothQuant calibration texts (`worker.calibration`: never the gate's texts)."""
    unsigned_gelu: bool = True
    """Per-row only: the FFN output's input (a GELU, >= -0.17) shifted and quantized to uint8 0..255,
    twice symmetric int8's resolution, the shift's product subtracted per column."""
    keep_fp32: tuple[str, ...] = ()
    """Per-row only: MatMul roles left in fp32 (`worker.onnx_export.int8_graph.ROLES`): mixed precision."""
    outlier_channels: int = 32
    """Per-row only: the input channels of each MatMul group with the largest calibrated max |x| (at most
    an eighth of them) multiplied in fp32, outside the int8 product (LLM.int8()'s decomposition, fixed
    at export). Trained transformers carry a few huge LayerNorm channels; in a per-row scale they
    leave the other channels a handful of int8 levels. 0: none."""
    per_channel: bool = True
    """One weight scale per output column rather than per matrix (per-row always is per column)."""
    op_types: tuple[str, ...] = ("MatMul",)
    """Operators quantized; the embedding Gather stays fp32 (it costs a lookup, not compute)."""
    gptq: bool = False
    """Per-row only: weights rounded by GPTQ (`gptq.gptq_round`), each rounding error pushed onto
    the input channels not yet rounded, weighed by the calibration inputs' X^T X; same integers' cost,
    less error than round-to-nearest (docs/int8-recipes.md). Off until its 7-bit graph is shown to score
    alike on AVX2 and VNNI kernels on every tiny checkpoint (it moved 1.2e-3 on one)."""
    reduce_range: bool = False
    """7-bit weights: on x86 CPUs without int8 dot products (VNNI, AMX) ONNX Runtime's u8 x s8 products
    sum in saturating int16 pairs, and 7-bit weights keep every pair in range (`rowwise.INT7_MAX`). The
    export builds its second int8 graph this way (`seven_bit_weights`)."""

    @property
    def calibrated(self) -> bool:
        """Whether building it reads activation statistics (`worker.calibration`'s texts)."""
        return self.activations == PER_ROW and (self.smooth_alpha is not None or self.outlier_channels > 0
                                                 or self.gptq)

    def record(self) -> dict[str, Any]:
        """The recipe as the manifest stores it (JSON types: tuples as lists)."""
        recorded: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        return recorded


DEFAULT_INT8 = Int8Recipe()


def seven_bit_weights(recipe: Int8Recipe) -> Int8Recipe:
    """`recipe` with 7-bit weights: how the export's `INT8_W7_MODEL` is built from its recorded recipe."""
    return replace(recipe, reduce_range=True)


def int8_records(recipe: Int8Recipe = DEFAULT_INT8) -> dict[str, dict[str, Any]]:
    """The recipe of each int8 graph an export built by `recipe` holds, by file: what a fidelity
    decision records, since it gated both."""
    return {INT8_MODEL: recipe.record(), INT8_W7_MODEL: seven_bit_weights(recipe).record(),
            INT8_U8_MODEL: recipe.record()}

PER_TENSOR_INT8 = Int8Recipe(activations=PER_TENSOR, smooth_alpha=None, unsigned_gelu=False, outlier_channels=0,
                             gptq=False)
"""ONNX Runtime's dynamic quantization, the export's former int8 recipe (benchmarks only)."""


def verify_int8_recipe(directory: Path, manifest: Manifest, recipe: Int8Recipe = DEFAULT_INT8) -> None:
    """ExportError (with the command to run) unless the export's int8 graph was built by `recipe`."""
    if manifest.int8 != recipe.record():
        raise ExportError(f"stale export at {directory}: its int8 graph was built by recipe {manifest.int8}, this "
                          f"worker runs {recipe.record()}; {REBUILD_HINT}")


@dataclass
class Manifest:
    """What an export was built from and with; workers compare it with what they run."""

    format: int
    checkpoint_sha256: str
    checkpoint: str
    identity: str
    labels: list[str]
    num_outputs: int
    tokenizer_class: str
    max_tokens: int
    opset: int
    exporter: str
    fusions: dict[str, int]
    int8: dict[str, Any]
    versions: dict[str, str | None]
    files: dict[str, str]
    cpu: str
    kernel_signature: str
    created: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(**data)


def installed_version(dist: str) -> str | None:
    """A package's installed version without importing it (None if absent)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_file(settings: WorkerSettings) -> Path:
    """The file Detoxify loads: TOXFLEET_CHECKPOINT, or the torch hub cache file of TOXFLEET_MODEL."""
    if settings.checkpoint is not None:
        return settings.checkpoint.resolve()
    url = DETOXIFY_URLS.get(settings.model)
    if url is None:
        raise ExportError(f"unknown TOXFLEET_MODEL={settings.model!r}")
    path = torch_hub_checkpoint(url)
    if not path.is_file():
        raise ExportError(f"no weights for {settings.model!r} at {path}; run a worker once (it downloads them) "
                          "or set TOXFLEET_CHECKPOINT")
    return path


def export_root(settings: WorkerSettings, checkpoint: Path) -> Path:
    return settings.export_dir.resolve() if settings.export_dir is not None else checkpoint.parent / "exports"


_checkpoint_sha: dict[tuple[Path, int, int, int], str] = {}
"""Checkpoint sha256 by (path, inode, size, mtime): a process hashes a checkpoint once, and the pool
processes a worker forks inherit what its main process hashed."""


def checkpoint_sha256(checkpoint: Path) -> str:
    """The checkpoint's sha256, hashed once per process while the file is unchanged."""
    st = checkpoint.stat()
    key = (checkpoint, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _checkpoint_sha:
        _checkpoint_sha[key] = sha256_file(checkpoint)
    return _checkpoint_sha[key]


def export_location(settings: WorkerSettings) -> tuple[Path, str]:
    """(directory of this checkpoint's export, checkpoint sha256); hashes the checkpoint once per process."""
    checkpoint = checkpoint_file(settings)
    sha = checkpoint_sha256(checkpoint)
    return export_root(settings, checkpoint) / sha, sha


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ExportError(f"no export at {directory}; {REBUILD_HINT}")
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, TypeError) as exc:
        raise ExportError(f"corrupt manifest {path} ({exc}); {REBUILD_HINT}") from None


def verify_export(directory: Path, checkpoint_sha: str, files: Sequence[str] | None = None) -> Manifest:
    """The manifest, if the export in `directory` is current and `files` (default: all it lists) are
    intact; else ExportError."""
    manifest = read_manifest(directory)
    if manifest.format != EXPORT_FORMAT:
        raise ExportError(f"stale export at {directory}: format {manifest.format}, this worker reads "
                          f"{EXPORT_FORMAT}; {REBUILD_HINT}")
    if manifest.checkpoint_sha256 != checkpoint_sha:
        raise ExportError(f"stale export at {directory}: made from checkpoint sha256 "
                          f"{manifest.checkpoint_sha256[:12]}, the checkpoint is {checkpoint_sha[:12]}; {REBUILD_HINT}")
    for dist in RUNTIME_PINNED:
        have, made = installed_version(dist), manifest.versions.get(dist)
        if have is not None and have != made:
            raise ExportError(f"stale export at {directory}: made with {dist} {made}, this worker has {have}; "
                              f"{REBUILD_HINT}")
    for name in sorted(manifest.files) if files is None else files:
        expected = manifest.files.get(name)
        path = directory / name
        if expected is None:
            raise ExportError(f"export at {directory} lists no {name}; {REBUILD_HINT}")
        if not path.is_file():
            raise ExportError(f"export at {directory} lacks {name}; {REBUILD_HINT}")
        if sha256_file(path) != expected:
            raise ExportError(f"corrupt export: {path} does not match its sha256 in the manifest; {REBUILD_HINT}")
    return manifest
