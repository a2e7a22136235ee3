"""Ahead-of-time ONNX export and int8 quantization of a Detoxify checkpoint, cached by its sha256.

Workers never export: they load what this command built, and refuse an export that is missing,
stale (another export format, checkpoint, onnxruntime or transformers version) or corrupt (a file
whose sha256 differs from the manifest) with one line naming the command to run. The command
rebuilds what is missing or stale, runs the fidelity gate on this CPU and writes the decision that
`TOXFLEET_BACKEND=auto` reads:

    python -m worker.export                # reads TOXFLEET_CHECKPOINT / TOXFLEET_HF_CONFIG / TOXFLEET_MODEL
    python -m worker.export --check        # verify only; exit 1 with the reason if a worker would refuse it
    python -m worker.export --no-gate      # artifacts only (the gate needs minutes on a full-size model)

Layout, next to the checkpoint unless TOXFLEET_EXPORT_DIR says otherwise:

    exports/<checkpoint sha256>/manifest.json    hashes, versions, opset, labels, int8 recipe
                               model.onnx        fp32, constant-folded, transformer ops fused
                               model-int8.onnx   dynamic int8 (QOperator MatMulInteger) of model.onnx
                               tokenizer/        Detoxify's tokenizer, saved, so no hub and no torch at run time
                               decision.json     the fidelity gate's table and the backend `auto` picks

Export path, and why: `torch.onnx.export(dynamo=True)` (the default in torch 2.13). The TorchScript
exporter (`dynamo=False`) traced transformers 5's attention-mask construction into a graph that
mishandles padding (max logit difference 2-3 on the tiny checkpoint, measured); the dynamo graph
matches torch to 1e-5. The model is exported with eager attention so that ONNX Runtime's transformer
optimizer can fuse the layer (SkipLayerNormalization, FastGelu); SDPA exports add NaN guards per layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from worker.cpus import cpu_model_name, kernel_signature
from worker.settings import WorkerSettings

EXPORT_FORMAT = 1
"""Version of this layout and recipe; an export of another format is stale."""

MANIFEST_FILE = "manifest.json"
FP32_MODEL = "model.onnx"
INT8_MODEL = "model-int8.onnx"
TOKENIZER_DIR = "tokenizer"
DECISION_FILE = "decision.json"

RUNTIME_PINNED = ("onnxruntime", "transformers")
"""Packages a worker must run at the exported version: onnxruntime produced the fused and quantized
graphs and its kernels are what the gate measured; transformers saved and loads the tokenizer."""

EXPORT_TOOLS = ("torch", "onnx", "onnxscript", "onnxruntime", "transformers", "detoxify")
"""Versions recorded in the manifest."""

EXPORT_CHECK_TOLERANCE = 1e-3
"""Most absolute logit difference between the fp32 export and torch on a padded probe batch; a larger
one means the exporter dropped something (the attention mask, say) and the export is refused."""

REBUILD_HINT = "run `python -m worker.export` with the same TOXFLEET_* settings to rebuild it"


class ExportError(RuntimeError):
    """An export a worker must not use; the message says why and what to run."""


@dataclass(frozen=True)
class Int8Recipe:
    """How `model-int8.onnx` is quantized (`onnxruntime.quantization.quantize_dynamic`, QOperator).

    Dynamic quantization computes each activation's scale per batch at run time, so it needs no
    calibration data; static QDQ would fix activation scales from a calibration corpus and add error.
    """

    per_channel: bool = True
    """One weight scale per output column rather than per matrix."""
    op_types: tuple[str, ...] = ("MatMul",)
    """Operators quantized; the embedding Gather stays fp32 (it costs a lookup, not compute)."""
    reduce_range: bool = False
    """7-bit weights: only needed on CPUs without VNNI, where u8 x s8 products can saturate."""


DEFAULT_INT8 = Int8Recipe()


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
    from worker.lifecycle import DETOXIFY_URLS, _torch_hub_checkpoint

    url = DETOXIFY_URLS.get(settings.model)
    if url is None:
        raise ExportError(f"unknown TOXFLEET_MODEL={settings.model!r}")
    path = _torch_hub_checkpoint(url)
    if not path.is_file():
        raise ExportError(f"no weights for {settings.model!r} at {path}; run a worker once (it downloads them) "
                          "or set TOXFLEET_CHECKPOINT")
    return path


def export_root(settings: WorkerSettings, checkpoint: Path) -> Path:
    return settings.export_dir.resolve() if settings.export_dir is not None else checkpoint.parent / "exports"


def export_location(settings: WorkerSettings) -> tuple[Path, str]:
    """(directory of this checkpoint's export, checkpoint sha256); hashes the checkpoint once."""
    checkpoint = checkpoint_file(settings)
    sha = sha256_file(checkpoint)
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


# --- building (needs torch, onnx, onnxscript, onnxruntime) -------------------------------------------


def export_onnx(model: Any, path: Path, vocab_size: int, pad_id: int) -> str:
    """Export `model` (ids, mask) -> logits with dynamic batch and sequence axes; returns the exporter."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)[0]

    # A padded probe, so nothing in the graph can specialise on an all-ones mask.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, max(6, vocab_size - 1), (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, 9:] = pad_id
    mask[1, 9:] = 0
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamo=True, external_data=False, verbose=False,
                          dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    return f"torch.onnx.export(dynamo=True) torch {torch.__version__}"


def fold(src: Path, dst: Path) -> None:
    """ONNX Runtime's basic (hardware-independent) graph optimizations, saved: constant folding turns
    ALBERT's shared, transposed weights into initializers the quantizer can see."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def fuse(src: Path, dst: Path, num_heads: int, hidden_size: int) -> dict[str, int]:
    """ONNX Runtime's transformer fusions (`model_type="bert"` covers ALBERT/BERT/RoBERTa/XLM-R graphs)."""
    from onnxruntime.transformers import optimizer

    model = optimizer.optimize_model(str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                     opt_level=0)
    model.save_model_to_file(str(dst))
    stats = model.get_fused_operator_statistics()
    return {op: int(n) for op, n in stats.items() if n}


def quantize_int8(src: Path, dst: Path, recipe: Int8Recipe = DEFAULT_INT8) -> None:
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The quantizer logs a hint about static-quantization pre-processing on the root logger; it does
    # not apply to dynamic quantization. Quiet it for this call only.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=recipe.per_channel,
                         reduce_range=recipe.reduce_range, op_types_to_quantize=list(recipe.op_types))
    finally:
        root.setLevel(level)


def check_against_torch(model: Any, path: Path, vocab_size: int, pad_id: int) -> float:
    """Largest logit difference between the ONNX graph and torch on a padded batch of mixed lengths."""
    import numpy as np
    import onnxruntime as ort
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, max(6, vocab_size - 1), (3, 40), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in ((1, 7), (2, 23)):
        ids[row, length:] = pad_id
        mask[row, length:] = 0
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask)[0].numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    return float(np.abs(got - expected).max())


def build_export(settings: WorkerSettings, recipe: Int8Recipe = DEFAULT_INT8,
                 directory: Path | None = None) -> Path:
    """Export, fuse and quantize this checkpoint into its cache directory (replaced atomically)."""
    import onnx

    from worker.backend import load_detoxify

    checkpoint = checkpoint_file(settings)
    sha = sha256_file(checkpoint)
    target = directory or export_root(settings, checkpoint) / sha
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=target.parent))
    work.chmod(0o755)  # mkdtemp makes it private; workers may run as another user
    try:
        detoxify = load_detoxify(settings)
        model = detoxify.model.eval()
        tokenizer = detoxify.tokenizer
        config = model.config
        # Eager attention exports as plain MatMul/Softmax, which ONNX Runtime fuses; numerically the same.
        model.set_attn_implementation("eager")
        raw, folded = work / "raw.onnx", work / "folded.onnx"
        exporter = export_onnx(model, raw, config.vocab_size, tokenizer.pad_token_id)
        fold(raw, folded)
        try:
            fusions = fuse(folded, work / FP32_MODEL, config.num_attention_heads, config.hidden_size)
        except Exception as exc:  # an architecture the fuser does not know still exports, unfused
            print(f"toxfleet export: transformer fusion failed ({exc!r}); keeping the unfused graph", file=sys.stderr)
            shutil.copyfile(folded, work / FP32_MODEL)
            fusions = {}
        diff = check_against_torch(model, work / FP32_MODEL, config.vocab_size, tokenizer.pad_token_id)
        if not diff <= EXPORT_CHECK_TOLERANCE:
            raise ExportError(f"the ONNX export does not reproduce the torch model (max logit difference {diff:.3g} "
                              f"> {EXPORT_CHECK_TOLERANCE}); refusing it")
        quantize_int8(work / FP32_MODEL, work / INT8_MODEL, recipe)
        for scratch in (raw, folded):
            scratch.unlink()
        tokenizer.save_pretrained(work / TOKENIZER_DIR)
        opset = next((o.version for o in onnx.load(str(work / FP32_MODEL), load_external_data=False).opset_import
                      if o.domain in ("", "ai.onnx")), 0)
        files = {str(p.relative_to(work)): sha256_file(p) for p in sorted(work.rglob("*")) if p.is_file()}
        manifest = Manifest(
            format=EXPORT_FORMAT, checkpoint_sha256=sha, checkpoint=str(checkpoint), identity=settings.model_identity,
            labels=list(detoxify.class_names), num_outputs=int(config.num_labels),
            tokenizer_class=type(tokenizer).__name__, max_tokens=512, opset=int(opset), exporter=exporter,
            fusions=fusions, int8=asdict(recipe), versions={d: installed_version(d) for d in EXPORT_TOOLS},
            files=files, cpu=cpu_model_name(), kernel_signature=kernel_signature())
        (work / MANIFEST_FILE).write_text(manifest.to_json())
        _replace_dir(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`, replacing any old export with two renames (workers never see a half)."""
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name[:12]}-{os.getpid()}")
        target.rename(old)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def ensure_export(settings: WorkerSettings, force: bool = False, recipe: Int8Recipe = DEFAULT_INT8) -> Path:
    """This checkpoint's export directory, rebuilt if forced, missing, stale or corrupt."""
    directory, sha = export_location(settings)
    if not force:
        try:
            manifest = verify_export(directory, sha)
            if manifest.int8 == json.loads(json.dumps(asdict(recipe))):
                return directory
            print(f"toxfleet export: int8 recipe changed; rebuilding {directory}", file=sys.stderr)
        except ExportError as exc:
            print(f"toxfleet export: {str(exc).replace('; ' + REBUILD_HINT, '')}; building", file=sys.stderr)
    return build_export(settings, recipe, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", 
                        help="verify the export only; exit 1 if a worker would refuse it")
    parser.add_argument("--force", action="store_true", help="rebuild even if the export is current")
    parser.add_argument("--no-gate", action="store_true", help="skip the fidelity gate and the auto decision")
    parser.add_argument("--texts", type=int, default=None, help="gate corpus size (default: worker.fidelity's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="export root, as TOXFLEET_EXPORT_DIR (workers must then be given the same value)")
    args = parser.parse_args(argv)
    if args.out is not None:
        os.environ["TOXFLEET_EXPORT_DIR"] = str(args.out)
    settings = WorkerSettings()
    if args.check:
        try:
            directory, sha = export_location(settings)
            verify_export(directory, sha)
        except ExportError as exc:
            print(f"toxfleet export: {exc}", file=sys.stderr)
            return 1
        print(f"export OK: {directory}")
        return 0
    started = time.perf_counter()
    try:
        directory = ensure_export(settings, force=args.force)
    except ExportError as exc:
        print(f"toxfleet export: {exc}", file=sys.stderr)
        return 1
    print(f"export: {directory} ({time.perf_counter() - started:.1f}s)")
    if args.no_gate:
        return 0
    from worker import fidelity

    return fidelity.main(["--write-decision"] + ([] if args.texts is None else ["--texts", str(args.texts)]))


if __name__ == "__main__":
    sys.exit(main())
