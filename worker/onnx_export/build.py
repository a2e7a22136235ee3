"""Build this checkpoint's export: ONNX export, transformer fusion, int8 quantization, a check against
torch, then the manifest (`worker.onnx_export.artifacts`), replacing any old export atomically.

Export path, and why: `torch.onnx.export(dynamo=True)` (the default in torch 2.13). The TorchScript
exporter (`dynamo=False`) traced transformers 5's attention-mask construction into a graph that
mishandles padding (logits off by whole units); the dynamo graph
matches torch to 1e-5. The model is exported with eager attention so that ONNX Runtime's transformer
optimizer can fuse the layer (SkipLayerNormalization, FastGelu); SDPA exports add NaN guards per layer.

Building needs torch, onnx, onnxscript and onnxruntime (the `onnx` extra); each is imported by the
step that uses it, so that importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.backends.base import pad_batch
from worker.calibration import calibration_texts
from worker.cpus import cpu_model_name, kernel_signature
from worker.onnx_export.artifacts import (
    DEFAULT_INT8,
    EXPORT_FORMAT,
    FP32_MODEL,
    INT8_MODEL,
    INT8_U8_MODEL,
    INT8_W7_MODEL,
    MANIFEST_FILE,
    PER_ROW,
    PER_TENSOR,
    REBUILD_HINT,
    REFERENCE_FILE,
    TOKENIZER_DIR,
    ExportError,
    Int8Recipe,
    Manifest,
    checkpoint_file,
    export_location,
    export_root,
    installed_version,
    seven_bit_weights,
    sha256_file,
    verify_export,
)

if TYPE_CHECKING:
    from worker.onnx_export.int8_graph import Calibration
from worker.settings import WorkerSettings
from worker.weights import load_detoxify

EXPORT_TOOLS = ("torch", "onnx", "onnxscript", "onnxruntime", "transformers", "detoxify")
"""Versions recorded in the manifest."""

EXPORT_CHECK_TOLERANCE = 1e-3
"""Most absolute logit difference between the fp32 export and torch on a padded probe batch; a larger
one means the exporter dropped something (the attention mask, say) and the export is refused."""




def export_onnx(model: Any, path: Path, vocab_size: int, pad_id: int) -> str:
    """Export `model` (ids, mask) -> logits with dynamic batch and sequence axes; returns the exporter."""
    import torch  # heavy optional dependency: only the export command needs it

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


def export_first_token(model: Any, path: Path, vocab_size: int, pad_id: int) -> str:
    """`export_onnx` with the last layer computed for the first token only (`first_token.first_token_only`),
    or the whole model where its layers are not recognised (said on stderr); returns the exporter."""
    import torch  # heavy optional dependency: only the export command needs it

    from worker.onnx_export.first_token import FirstTokenError, first_token_only

    try:  # an eager probe first: a model whose layers do not run as found fails here, not inside the tracer
        with first_token_only(model), torch.inference_mode():
            model(input_ids=torch.ones((1, 4), dtype=torch.long), attention_mask=torch.ones((1, 4), dtype=torch.long))
    except FirstTokenError as exc:
        print(f"toxfleet export: {exc}; exporting every token of the last layer", file=sys.stderr)
        return export_onnx(model, path, vocab_size, pad_id)
    with first_token_only(model):
        return export_onnx(model, path, vocab_size, pad_id) + ", last layer for the first token"


def fold(src: Path, dst: Path) -> None:
    """ONNX Runtime's basic (hardware-independent) graph optimizations, saved: constant folding turns
    ALBERT's shared, transposed weights into initializers the quantizer can see."""
    import onnxruntime as ort  # heavy optional dependency: only the export command needs it

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def fuse(src: Path, dst: Path, num_heads: int, hidden_size: int) -> dict[str, int]:
    """ONNX Runtime's transformer fusions (`model_type="bert"` covers ALBERT/BERT/RoBERTa/XLM-R graphs)."""
    from onnxruntime.transformers import optimizer  # heavy optional dependency: only the export needs it

    model = optimizer.optimize_model(str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                     opt_level=0)
    model.save_model_to_file(str(dst))
    stats = model.get_fused_operator_statistics()
    return {op: int(n) for op, n in stats.items() if n}


def calibration_feeds(tokenizer: Any, texts: list[str], pass_tokens: int = 1024,
                      pass_texts: int = 16) -> list[dict[str, Any]]:
    """The calibration texts as padded ONNX feeds, cut into passes the way a worker cuts them."""
    from worker.scorer import plan_passes

    ids = tokenizer(texts, truncation=True, max_length=512)["input_ids"]
    left = tokenizer.padding_side == "left"
    feeds = []
    for group in plan_passes([len(s) for s in ids], pass_tokens, pass_texts):
        batch_ids, mask = pad_batch([ids[j] for j in group], int(tokenizer.pad_token_id), left)
        feeds.append({"input_ids": batch_ids, "attention_mask": mask})
    return feeds


def calibrate_int8(src: Path, recipe: Int8Recipe, feeds: list[dict[str, Any]] | None) -> Calibration | None:
    """What `recipe`'s per-row int8 graphs of `src` read from the calibration `feeds` (`rowwise.calibrate`),
    or None when the recipe reads nothing."""
    if recipe.activations != PER_ROW or not recipe.calibrated:
        return None
    if not feeds:
        raise ValueError("a calibrated int8 recipe (SmoothQuant, outliers, GPTQ) needs calibration feeds")
    from worker.onnx_export import int8_graph as rowwise

    return rowwise.calibrate(src, feeds, hessians=recipe.gptq)


def quantize_int8(src: Path, dst: Path, recipe: Int8Recipe = DEFAULT_INT8,
                  feeds: list[dict[str, Any]] | None = None, calibration: Calibration | None = None) -> dict[str, int]:
    """Write the int8 graph of `src` by `recipe`; `feeds` (`calibration_feeds`) when it is calibrated, or
    what they give (`calibrate_int8`), when already computed. Returns what the per-row rewrite counted
    (empty for the per-tensor quantizer)."""
    if recipe.activations == PER_ROW:
        from worker.onnx_export import int8_graph as rowwise

        if calibration is None:
            calibration = calibrate_int8(src, recipe, feeds)
        act_max, hessians = calibration or (None, None)
        uses_maxima = recipe.smooth_alpha is not None or recipe.outlier_channels > 0
        return rowwise.rowwise_int8(src, dst, act_max if uses_maxima else None, recipe.smooth_alpha,
                                    recipe.keep_fp32, recipe.unsigned_gelu, recipe.outlier_channels,
                                    weight_levels=rowwise.INT7_MAX if recipe.reduce_range else rowwise.INT8_MAX,
                                    hessians=hessians if recipe.gptq else None)
    if recipe.activations != PER_TENSOR:
        raise ValueError(f"unknown int8 activations {recipe.activations!r}")
    from onnxruntime.quantization import QuantType, quantize_dynamic  # heavy optional dependency (export only)

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
    return {}


def quantize_int8_graphs(src: Path, work: Path, recipe: Int8Recipe, feeds: list[dict[str, Any]] | None) -> None:
    """The int8 graphs of an export into `work`: `INT8_MODEL` by `recipe`; for CPUs without int8 dot
    products, `INT8_W7_MODEL` by its 7-bit-weight twin (`seven_bit_weights`) and `INT8_U8_MODEL`, the
    first with uint8 weights (`rowwise.unsigned_weights`); one calibration."""
    from worker.onnx_export import int8_graph as rowwise

    calibration = calibrate_int8(src, recipe, feeds)
    quantize_int8(src, work / INT8_MODEL, recipe, feeds, calibration)
    quantize_int8(src, work / INT8_W7_MODEL, seven_bit_weights(recipe), feeds, calibration)
    rowwise.unsigned_weights(work / INT8_MODEL, work / INT8_U8_MODEL)


def check_against_torch(model: Any, path: Path, vocab_size: int, pad_id: int) -> float:
    """Largest logit difference between the ONNX graph and torch on a padded batch of mixed lengths."""
    # Heavy optional dependencies: only the export command needs them.
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
    import onnx  # heavy optional dependency: only the export command needs it

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
        exporter = export_first_token(model, raw, config.vocab_size, tokenizer.pad_token_id)
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
        feeds = None
        if recipe.calibrated:
            feeds = calibration_feeds(tokenizer, calibration_texts(recipe.calibration_texts),
                                      settings.pass_tokens, settings.pass_texts)
        quantize_int8_graphs(work / FP32_MODEL, work, recipe, feeds)
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
            fusions=fusions, int8=recipe.record(), versions={d: installed_version(d) for d in EXPORT_TOOLS},
            files=files, cpu=cpu_model_name(), kernel_signature=kernel_signature())
        (work / MANIFEST_FILE).write_text(manifest.to_json())
        if (target / REFERENCE_FILE).is_file():  # the reference's scores outlive the graphs (their key checks them)
            shutil.copyfile(target / REFERENCE_FILE, work / REFERENCE_FILE)
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
            if manifest.int8 == recipe.record():
                return directory
            print(f"toxfleet export: int8 recipe changed; rebuilding {directory}", file=sys.stderr)
        except ExportError as exc:
            print(f"toxfleet export: {str(exc).replace('; ' + REBUILD_HINT, '')}; building", file=sys.stderr)
    return build_export(settings, recipe, directory)
