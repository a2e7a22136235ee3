"""The inference backend contract, and the reference backend: Detoxify's own torch model.

A backend owns a tokenizer and a model and answers two questions: how a text tokenizes, and what
the probabilities of a padded batch of token sequences are. Batch planning (sorting, padding
budgets) lives in `worker.scorer`, so every backend gets it for free. Nothing here is imported
before a worker process starts loading its model.

Backends (TOXFLEET_BACKEND): `torch` is the reference, exactly Detoxify's model in fp32; the others
(`worker.reduced_torch`, `worker.onnx_backend`) run the same weights a cheaper way and must pass the
fidelity gate (`worker.fidelity`) against it before `auto` may pick them (`worker.selection`).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from toxfleet.contract import MODEL_MAX_TOKENS, WINDOW_OVERLAP_TOKENS, window_starts
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

FP32 = "fp32"
"""Precision class of backends that compute in fp32: held to the tight fidelity budget."""

REDUCED = "reduced"
"""Precision class of quantized or bf16 backends: held to the looser fidelity budget."""


class Backend(ABC):
    """Tokenize texts and score padded batches: `predict(batch)` is list in, list out."""

    #: The TOXFLEET_BACKEND value that builds this backend.
    name: str
    #: `FP32` or `REDUCED`: which fidelity budget applies (`worker.fidelity`).
    precision: str = FP32
    #: Labels returned, in model output order (Detoxify's `class_names`).
    labels: list[str]
    #: What results report as the model that scored them.
    identity: str
    #: Seconds `load_backend` took to build this backend (weights, quantization, session).
    load_seconds: float = 0.0

    @abstractmethod
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included, truncated to the model's length."""

    @abstractmethod
    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        """Probabilities per sequence, one per label; the batch is padded to its longest sequence."""

    def describe(self) -> dict[str, Any]:
        """What logs, the heartbeat and benchmarks report about this backend."""
        return {"backend": self.name, "precision": self.precision, "model": self.identity,
                "labels": len(self.labels), "load_seconds": round(self.load_seconds, 3)}

    def tokenize_windows(self, texts: Sequence[str], overlap: int = WINDOW_OVERLAP_TOKENS) -> list[list[list[int]]]:
        """Per text, token ids of overlapping windows of the model's length, special tokens included;
        a text that fits gives one window, equal to `tokenize`'s (long_text="windows"). Every backend
        that keeps its Hugging Face tokenizer in `_tokenizer` (all of them today) gets this for free."""
        tokenizer = getattr(self, "_tokenizer", None)
        if tokenizer is None:
            raise NotImplementedError(f"{type(self).__name__} does not support long_text='windows'")
        return hf_windows(tokenizer, texts, overlap)


def hf_windows(tokenizer: Any, texts: Sequence[str], overlap: int = WINDOW_OVERLAP_TOKENS,
               max_tokens: int = MODEL_MAX_TOKENS) -> list[list[list[int]]]:
    """`Backend.tokenize_windows` for any Hugging Face tokenizer: tokenize without truncation or
    special tokens, cut windows (`contract.window_starts`), then wrap each in the special tokens the
    tokenizer itself adds, found by tokenizing a probe with and without them."""
    with_special = tokenizer("x")["input_ids"]
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(with_special)) if with_special[i: i + len(bare)] == bare)
    prefix, suffix = with_special[:start], with_special[start + len(bare):]
    size = max_tokens - len(prefix) - len(suffix)
    # verbose=False: the "longer than the maximum sequence length" warning is the point here.
    content: list[list[int]] = tokenizer(list(texts), add_special_tokens=False, truncation=False,
                                         verbose=False)["input_ids"]
    return [[prefix + ids[s: s + size] + suffix for s in window_starts(len(ids), size, overlap)] for ids in content]


class TorchBackend(Backend):
    """The reference: exactly the model and tokenizer `detoxify.Detoxify` loads, in fp32."""

    name = "torch"

    def __init__(self, detoxify: Any, identity: str) -> None:
        import torch

        self._torch = torch
        self._model = detoxify.model.eval()
        self._tokenizer = detoxify.tokenizer
        self.labels = list(detoxify.class_names)
        self.identity = identity

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        # max_length explicitly: a tokenizer saved without model_max_length would not truncate,
        # and a text over 512 tokens would crash the position embeddings.
        ids: list[list[int]] = self._tokenizer(list(texts), truncation=True, max_length=MODEL_MAX_TOKENS)["input_ids"]
        return ids

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        torch = self._torch
        inputs = self._tokenizer.pad({"input_ids": [list(s) for s in batch]}, return_tensors="pt")
        with torch.inference_mode():
            logits = self._model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])[0]
            probs = torch.sigmoid(logits[:, : len(self.labels)])
        out: list[list[float]] = probs.tolist()
        return out


def load_detoxify(settings: WorkerSettings) -> Any:
    """Load through Detoxify's own code: by name (downloads, or the torch hub cache) or offline from a
    Detoxify-format checkpoint plus a local HF config/tokenizer directory."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from detoxify import Detoxify

    if settings.checkpoint is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return Detoxify(checkpoint=str(settings.checkpoint),
                        huggingface_config_path=str(settings.hf_config) if settings.hf_config else None)
    return Detoxify(settings.model)


def load_backend(settings: WorkerSettings) -> Backend:
    """Build the configured backend in this process (`auto` resolved by `worker.selection`).

    Nothing is exported or measured here: ONNX backends load what `python -m worker.export` built
    and refuse, with the command to run, an export that is missing, stale or corrupt.
    """
    from worker.selection import resolve_backend

    name, reason = resolve_backend(settings)
    if settings.backend == "auto":
        logger.info("TOXFLEET_BACKEND=auto: using %s (%s)", name, reason)
    started = time.perf_counter()
    backend: Backend
    if name in ("onnx", "onnx-int8"):
        # No torch import on this path: an image without torch can run it.
        from worker.onnx_backend import load_onnx_backend

        backend = load_onnx_backend(settings, int8=name == "onnx-int8")
    else:
        import torch

        torch.set_num_threads(settings.torch_threads)
        detoxify = load_detoxify(settings)
        if name == "torch":
            backend = TorchBackend(detoxify, settings.model_identity)
        elif name == "torch-int8":
            from worker.reduced_torch import TorchInt8Backend

            backend = TorchInt8Backend(detoxify, settings.model_identity)
        elif name == "torch-bf16":
            from worker.reduced_torch import TorchBf16Backend

            backend = TorchBf16Backend(detoxify, settings.model_identity)
        else:
            raise ValueError(f"unknown TOXFLEET_BACKEND={name!r}")
    backend.load_seconds = time.perf_counter() - started
    return backend
