"""The reference backend: Detoxify's own torch model in fp32 (its weights: `worker.weights`).

torch is imported when the backend is built, in the pool process that runs it, never at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from toxfleet.contract import MODEL_MAX_TOKENS
from worker.backends.base import Backend, pad_batch
from worker.backends.registry import REFERENCE


class TorchBackend(Backend):
    """The reference: exactly the model and tokenizer `detoxify.Detoxify` loads, in fp32."""

    name = REFERENCE  # the loader stamps every backend's registry name; this serves direct use

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run on this machine, or None. The loader asks before it loads the
        model, and the gate records the reason as a failed row."""
        return None

    @classmethod
    def require(cls) -> None:
        """Raise RuntimeError, saying why, if this backend cannot run on this machine."""
        reason = cls.unavailable()
        if reason is not None:
            raise RuntimeError(f"{cls.__name__} cannot run here: {reason}")

    def __init__(self, detoxify: Any, identity: str) -> None:
        self.require()
        import torch  # heavy, and absent from ONNX-only images: imported when this backend is built

        self._torch = torch
        self._model = detoxify.model.eval()
        self._tokenizer = detoxify.tokenizer
        self.labels = list(detoxify.class_names)
        self.identity = identity
        self._pad_id = int(self._tokenizer.pad_token_id)
        self._pad_left = self._tokenizer.padding_side == "left"

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        # max_length explicitly: a tokenizer saved without model_max_length would not truncate,
        # and a text over 512 tokens would crash the position embeddings.
        ids: list[list[int]] = self._tokenizer(list(texts), truncation=True, max_length=MODEL_MAX_TOKENS)["input_ids"]
        return ids

    def padded(self, batch: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The model's inputs for a batch: `input_ids` and `attention_mask`, as the tokenizer pads them."""
        ids, mask = pad_batch(batch, self._pad_id, self._pad_left)
        return {"input_ids": self._torch.from_numpy(ids), "attention_mask": self._torch.from_numpy(mask)}

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        torch = self._torch
        with torch.inference_mode():
            logits = self._model(**self.padded(batch))[0]
            probs = torch.sigmoid(logits[:, : len(self.labels)])
        out: list[list[float]] = probs.tolist()
        return out
