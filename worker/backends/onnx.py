"""Detoxify's model on ONNX Runtime: the fp32 export (`onnx`) or its int8 quantization (`onnx-int8`).

Loads only what `python -m worker.export` built and verified (never exports), and imports neither
torch nor Detoxify, so a worker image without torch can run it. What it keeps from Detoxify, on
purpose, because a circulating ONNX recipe for Detoxify gets both wrong:

- **sigmoid per label**, not softmax across labels: Detoxify is multi-label;
- **the attention mask is fed**: padded batches are scored as if each text were alone;
- the tokenizer Detoxify loads (saved into the export) and its label order (from the checkpoint).

The fidelity gate (`worker.gate.fidelity`) holds it to the torch reference on padded batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toxfleet.contract import MODEL_MAX_TOKENS
from worker.backends.base import FP32, REDUCED, Backend, pad_batch
from worker.onnx_export.artifacts import (
    FP32_MODEL,
    INT8_MODEL,
    INT8_U8_MODEL,
    INT8_W7_MODEL,
    TOKENIZER_DIR,
    Manifest,
    export_location,
    verify_export,
    verify_int8_recipe,
)
from worker.settings import WorkerSettings


def sigmoid(x: np.ndarray) -> np.ndarray:
    # float64 so that large negative logits do not overflow exp(); the output is float64 like torch's tolist.
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


class OnnxBackend(Backend):
    """An ONNX Runtime session on one exported graph, with the export's saved tokenizer."""

    def __init__(self, directory: Path, manifest: Manifest, model_file: str | Path, threads: int,
                 name: str | None = None, precision: str | None = None,
                 config: Mapping[str, str] | None = None) -> None:
        """`model_file` is relative to the export `directory` (or absolute, for benchmark variants);
        `config`: ONNX Runtime session config entries (measurement tools compare kernels with them)."""
        # Heavy runtimes, imported when a session is built (never by the main process, which only resolves).
        import onnxruntime as ort
        import transformers

        # The loader stamps the registry's name and precision; these defaults serve direct construction.
        self.name = name or str(model_file)
        self.precision = precision or (FP32 if str(model_file) == FP32_MODEL else REDUCED)
        self.labels = list(manifest.labels)
        self.identity = manifest.identity
        self.threads = threads
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # All levels: layout transforms and fusions for this CPU, applied at load.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        for key, value in (config or {}).items():
            options.add_session_config_entry(key, value)
        self._session = ort.InferenceSession(str(directory / model_file), options, providers=["CPUExecutionProvider"])
        tokenizer_class = getattr(transformers, manifest.tokenizer_class)
        self._tokenizer: Any = tokenizer_class.from_pretrained(str(directory / TOKENIZER_DIR))
        self._pad_id = int(self._tokenizer.pad_token_id)
        self._pad_left = self._tokenizer.padding_side == "left"

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        ids: list[list[int]] = self._tokenizer(list(texts), truncation=True, max_length=MODEL_MAX_TOKENS)["input_ids"]
        return ids

    def logits(self, batch: Sequence[Sequence[int]], with_mask: bool = True) -> np.ndarray:
        """Raw model outputs (all of them, identity heads included) for a padded batch."""
        ids, mask = pad_batch(batch, self._pad_id, self._pad_left)
        if not with_mask:
            mask = np.ones_like(mask)
        out: np.ndarray = self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return out

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        probs = sigmoid(self.logits(batch)[:, : len(self.labels)])
        out: list[list[float]] = probs.tolist()
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threads": self.threads}


def load_onnx_backend(settings: WorkerSettings, model_file: str) -> OnnxBackend:
    """The ONNX backend on graph `model_file` of this checkpoint's verified export (ExportError if unusable)."""
    directory, sha = export_location(settings)
    manifest = verify_export(directory, sha, files=[])
    # Hash only what this backend reads: the other model files may be large and are not our concern.
    needed = [model_file] + [name for name in manifest.files if name.startswith(TOKENIZER_DIR + "/")]
    verify_export(directory, sha, files=needed)
    if model_file != FP32_MODEL:
        verify_int8_recipe(directory, manifest)
    return OnnxBackend(directory, manifest, model_file, settings.torch_threads)


def load_onnx_fp32(settings: WorkerSettings) -> OnnxBackend:
    """The export's fp32 graph (the registry's loader of `onnx`)."""
    return load_onnx_backend(settings, FP32_MODEL)


def load_onnx_int8(settings: WorkerSettings) -> OnnxBackend:
    """The export's int8 graph (the registry's loader of `onnx-int8`)."""
    return load_onnx_backend(settings, INT8_MODEL)


def load_onnx_int8_w7(settings: WorkerSettings) -> OnnxBackend:
    """The export's int8 graph with 7-bit weights (the registry's loader of `onnx-int8-w7`)."""
    return load_onnx_backend(settings, INT8_W7_MODEL)


def load_onnx_int8_u8(settings: WorkerSettings) -> OnnxBackend:
    """The export's int8 graph with uint8 weights, on U8U8 kernels (the registry's loader of `onnx-int8-u8`)."""
    return load_onnx_backend(settings, INT8_U8_MODEL)
