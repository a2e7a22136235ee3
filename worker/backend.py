"""The inference backend contract, and the reference backend: Detoxify's own torch model.

A backend owns a tokenizer and a model and answers two questions: how a text tokenizes, and what
the probabilities of a padded batch of token sequences are. Batch planning (sorting, padding
budgets) lives in `worker.scorer`, so every backend gets it for free. Nothing here is imported
before a worker process starts loading its model.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from toxfleet.contract import MODEL_MAX_TOKENS
from worker.settings import WorkerSettings


class Backend(ABC):
    """Tokenize texts and score padded batches: `predict(batch)` is list in, list out."""

    #: Labels returned, in model output order (Detoxify's `class_names`).
    labels: list[str]
    #: What results report as the model that scored them.
    identity: str

    @abstractmethod
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included, truncated to the model's length."""

    @abstractmethod
    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        """Probabilities per sequence, one per label; the batch is padded to its longest sequence."""


class TorchBackend(Backend):
    """The reference: exactly the model and tokenizer `detoxify.Detoxify` loads, in fp32."""

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
    """Build the configured backend in this process."""
    import torch

    torch.set_num_threads(settings.torch_threads)
    if settings.backend == "torch":
        return TorchBackend(load_detoxify(settings), settings.model_identity)
    raise ValueError(f"unknown TOXFLEET_BACKEND={settings.backend!r} (known: torch)")
