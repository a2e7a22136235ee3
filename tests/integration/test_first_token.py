"""The export computes the last encoder layer for the first token only (`worker.onnx_export.first_token`):
the same scores as the whole model, on every architecture Detoxify ships, with the last layer's
feed-forward run on one token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from worker.onnx_export.artifacts import MANIFEST_FILE, export_location
from worker.onnx_export.first_token import FirstTokenError, encoder_layers, first_token_only
from worker.settings import WorkerSettings

SMALL = {"vocab_size": 120, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "intermediate_size": 64, "num_labels": 6, "max_position_embeddings": 64}

ARCHITECTURES = {
    # Detoxify's `original`, `unbiased`, `multilingual` and `-small` models, as small random instances.
    "bert": (transformers.BertConfig, transformers.BertForSequenceClassification, {}),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification, {"pad_token_id": 1}),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaForSequenceClassification,
                    {"pad_token_id": 1}),
    "albert": (transformers.AlbertConfig, transformers.AlbertForSequenceClassification, {"embedding_size": 16}),
}


def _model(kind: str) -> Any:
    config_class, model_class, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = model_class(config_class(**SMALL, **extra)).eval()
    model.set_attn_implementation("eager")  # what the export traces
    return model


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, SMALL["vocab_size"] - 1, (3, 21), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in ((1, 6), (2, 13)):  # padded rows: the keys must still see every real token only
        ids[row, length:] = 1
        mask[row, length:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _ffn_rows(model: Any) -> list[int]:
    """Tokens per call of every encoder layer's feed-forward output projection, in call order."""
    rows: list[int] = []
    layers = encoder_layers(model)
    handles = []
    for layer in layers:
        ffn = [m for name, m in layer.named_modules()
               if isinstance(m, torch.nn.Linear) and m.in_features == SMALL["intermediate_size"]]
        handles += [m.register_forward_hook(lambda _m, args, _o: rows.append(int(args[0].shape[1]))) for m in ffn]
    try:
        with torch.inference_mode():
            model(**_batch())
    finally:
        for handle in handles:
            handle.remove()
    return rows


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_the_last_layer_runs_for_the_first_token_alone_with_the_same_logits(kind: str) -> None:
    model = _model(kind)
    batch = _batch()
    with torch.inference_mode():
        whole = model(**batch).logits
        with first_token_only(model):
            cut = model(**batch).logits
            rows = _ffn_rows(model)
        again = model(**batch).logits
    tokens = batch["input_ids"].shape[1]
    # The saving: the last of the three layer calls runs its feed-forward on one token, the others on all.
    assert rows == [tokens, tokens, 1]
    assert _ffn_rows(model) == [tokens] * 3, "the hooks outlived the context"
    assert torch.allclose(cut, whole, atol=1e-5), (cut - whole).abs().max()
    assert torch.equal(again, whole)


def test_a_model_without_recognisable_layers_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(FirstTokenError, match="no encoder layers"), first_token_only(model):
        pass


def test_a_model_that_runs_fewer_layers_than_its_config_says_is_refused() -> None:
    model = _model("bert")
    model.config.num_hidden_layers = 5  # the model still runs its 3
    with (pytest.raises(FirstTokenError, match="3 encoder layer calls, the config says 5"),
          first_token_only(model), torch.inference_mode()):
        model(**_batch())


def test_the_export_says_it_cut_the_last_layer(exported: WorkerSettings) -> None:
    directory, _ = export_location(exported)
    manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    assert manifest["exporter"].endswith("last layer for the first token"), manifest["exporter"]


def test_the_exported_graph_runs_the_last_feed_forward_on_one_token(exported: WorkerSettings) -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from worker.onnx_export.artifacts import FP32_MODEL
    from worker.onnx_export.int8_graph import linear_matmuls, matmul_roles

    directory, _ = export_location(exported)
    model = onnx.load(str(Path(directory) / FP32_MODEL))
    roles = matmul_roles(model.graph)
    ffn_out = [n.output[0] for n in linear_matmuls(model.graph) if roles[n.output[0]] == "ffn-out"]
    assert len(ffn_out) == 2, ffn_out  # the tiny checkpoint's two layers, in graph order
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in ffn_out)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.full((2, 17), 5, dtype=np.int64)
    first, last = session.run(ffn_out, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert first.shape[:2] == (2, 17) and last.shape[:2] == (2, 1), (first.shape, last.shape)
