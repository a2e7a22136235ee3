"""The inference backend contract.

A backend owns a tokenizer and a model and answers two questions: how a text tokenizes, and what
the probabilities of a padded batch of token sequences are. Batch planning (sorting, padding
budgets) lives in `worker.scorer`, so every backend gets it for free.

Backends (TOXFLEET_BACKEND): `torch` is the reference, exactly Detoxify's model in fp32
(`worker.backends.torch`); the others (`worker.backends.reduced`, `worker.backends.onnx`) run the
same weights a cheaper way and must pass the fidelity gate (`worker.gate.fidelity`) against it
before `auto` may pick them (`worker.gate.selection`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from toxfleet.contract import MODEL_MAX_TOKENS, WINDOW_OVERLAP_TOKENS, window_starts

FP32 = "fp32"
"""Precision class of backends that compute in fp32: held to the tight fidelity budget."""

REDUCED = "reduced"
"""Precision class of quantized or bf16 backends: held to the looser fidelity budget."""


class Backend(ABC):
    """Tokenize texts and score padded batches: `predict(batch)` is list in, list out."""

    #: The TOXFLEET_BACKEND value that builds this backend.
    name: str
    #: `FP32` or `REDUCED`: which fidelity budget applies (`worker.gate.fidelity`).
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


def pad_batch(batch: Sequence[Sequence[int]], pad_id: int, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) as int64 arrays, padded to the longest sequence with `pad_id`: what a
    Hugging Face tokenizer's `pad(..., return_tensors=...)` gives for the same ids, for every backend. The
    tokenizer's own `pad` builds a `BatchEncoding` through several layers of Python, a cost a small
    model feels on every pass."""
    longest = max((len(seq) for seq in batch), default=0)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    for row, seq in enumerate(batch):
        span = slice(longest - len(seq), longest) if left else slice(0, len(seq))
        ids[row, span] = seq
        mask[row, span] = 1
    return ids, mask
