"""Per-row int8 quantization (`worker.backends.rowwise`, and the research recipes on it in
`tools.int8_recipes`): the arithmetic, the plan, and what makes it pass.

Pure logic on small tensors, plus one test on a BERT of the `original` layout built from config (no
download) that shows the property the recipe rests on: a text's scores do not depend on which
texts share its padded pass.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch

from tools.int8_recipes import (
    SmoothedInt8Linear,
    apply_smoothed_plan,
    linear_input_maxima,
    search_plan,
    smooth_scale,
)
from worker.backends.rowwise import (
    INT8_MAX,
    KEEP_FP32_DEFAULT,
    Bf16Linear,
    QuantPlan,
    RowwiseInt8Linear,
    apply_plan,
    default_plan,
    linear_names,
    output_projections,
    quantize_rows,
    quantize_weight,
)


def test_weight_quantization_is_per_output_channel_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    w[3] *= 1000  # one large channel must not coarsen the others
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (8,)
    assert q.abs().max() <= INT8_MAX
    error = (q.float() * scale[:, None] - w).abs()
    assert torch.all(error <= scale[:, None] / 2 + 1e-6)
    assert scale[0] < scale[3] / 100


def test_row_quantization_isolates_an_outlier_row():
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    alone, _ = quantize_rows(x[:1])
    x[2] *= 500  # an outlier token elsewhere in the pass
    together, scale = quantize_rows(x)
    assert torch.equal(alone[0], together[0])
    assert scale.shape == (4, 1)


def test_zero_rows_quantize_to_zero_without_nan():
    q, scale = quantize_rows(torch.zeros(2, 8))
    assert torch.all(q == 0) and torch.all(torch.isfinite(scale))


def test_rowwise_linear_matches_fp32_within_the_quantization_bound():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(3, 7, 64)
    q = RowwiseInt8Linear(linear)
    with torch.no_grad():
        expected = linear(x)
        got = q(x)
    assert got.shape == expected.shape
    relative = (got - expected).abs().max() / expected.abs().max()
    assert relative < 0.02


def test_smoothquant_moves_an_outlier_channel_into_the_weights():
    """An activation channel 50x larger than the rest coarsens every other channel of its row under
    per-row int8; SmoothQuant's x / s, W * s (s from calibration maxima) computes the same product
    with a much smaller error."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(200, 64)
    x[:, 5] *= 50
    act_max = x.abs().amax(dim=0)
    smooth = smooth_scale(act_max, linear.weight, 0.5)
    assert smooth.shape == (64,) and smooth[5] == smooth.max()
    with torch.no_grad():
        expected = linear(x)
        plain = (RowwiseInt8Linear(linear)(x) - expected).abs().mean()
        smoothed = (SmoothedInt8Linear(linear, smooth)(x) - expected).abs().mean()
    assert smoothed < 0.5 * plain


def test_a_smoothed_plan_smooths_only_the_calibrated_int8_layers():
    """SmoothQuant goes on the int8 layers that have calibration maxima; kept layers stay as the plan
    says, and an uncalibrated int8 layer gets the plain per-row form."""
    model = _tiny_bert()
    x = {"input_ids": torch.randint(5, 100, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    maxima = linear_input_maxima(model, [x])
    outputs = output_projections(linear_names(model))
    uncalibrated = "bert.encoder.layer.0.attention.self.key"
    del maxima[uncalibrated]
    apply_smoothed_plan(model, QuantPlan(keep_bf16=outputs), 0.5, maxima)
    assert isinstance(model.get_submodule("classifier"), torch.nn.Linear)
    assert all(isinstance(model.get_submodule(n), Bf16Linear) for n in outputs)
    assert isinstance(model.get_submodule("bert.encoder.layer.0.attention.self.query"), SmoothedInt8Linear)
    assert isinstance(model.get_submodule(uncalibrated), RowwiseInt8Linear)


def test_linear_input_maxima_records_each_linear_input_channel_max():
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.a(input_ids.float() * attention_mask)
            return out

    batches = [{"input_ids": torch.tensor([[1, -7, 2, 0]]), "attention_mask": torch.ones(1, 4)},
               {"input_ids": torch.tensor([[3, 1, -1, 0]]), "attention_mask": torch.ones(1, 4)}]
    maxima = linear_input_maxima(Tiny(), batches)
    assert maxima["a"].tolist() == [3.0, 7.0, 2.0, 0.0]


def test_rowwise_linear_without_bias():
    linear = torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        assert RowwiseInt8Linear(linear)(torch.randn(2, 16)).shape == (2, 8)


def test_bf16_linear_computes_close_to_fp32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16)
    x = torch.randn(5, 32)
    with torch.no_grad():
        got = Bf16Linear(linear)(x)
        assert got.dtype == torch.float32
        assert torch.allclose(got, linear(x), atol=0.05)


def _tiny_bert(labels: int = 6) -> Any:
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=labels)
    return transformers.BertForSequenceClassification(config).eval()


def test_apply_plan_keeps_the_classifier_and_named_layers():
    model = _tiny_bert()
    names = linear_names(model)
    outputs = output_projections(names)
    assert outputs == [n for n in names if n.endswith("output.dense")] and len(outputs) == 4
    apply_plan(model, QuantPlan(keep_bf16=outputs[:1]))
    assert isinstance(model.get_submodule("classifier"), torch.nn.Linear)
    assert isinstance(model.get_submodule(outputs[0]), Bf16Linear)
    assert isinstance(model.get_submodule(outputs[1]), RowwiseInt8Linear)
    assert isinstance(model.get_submodule("bert.encoder.layer.0.attention.self.query"), RowwiseInt8Linear)


def test_apply_plan_refuses_a_plan_for_another_model():
    with pytest.raises(ValueError, match="lacks"):
        apply_plan(_tiny_bert(), QuantPlan(keep_bf16=["albert.encoder.embedding_hidden_mapping_in"]))


def test_default_plan_finds_albert_output_projections():
    names = ["albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query",
             "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.dense",
             "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn",
             "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn_output"]
    assert output_projections(names) == [names[1], names[3]]
    assert default_plan(_tiny_bert()).keep_bf16 == output_projections(linear_names(_tiny_bert()))


def test_scores_do_not_depend_on_the_pass_a_text_shares():
    """The property per-tensor dynamic int8 lacks: pad a text beside a longer, louder one and its
    scores stay what they are alone (up to fp32 summation order)."""
    model = apply_plan(_tiny_bert(), QuantPlan())
    short = [2, 10, 11, 12, 3]
    loud = [2] + [50] * 30 + [3]
    with torch.inference_mode():
        alone = model(input_ids=torch.tensor([short]), attention_mask=torch.ones(1, 5, dtype=torch.long)).logits
        ids = torch.zeros(2, 32, dtype=torch.long)
        mask = torch.zeros(2, 32, dtype=torch.long)
        ids[0, :5], mask[0, :5] = torch.tensor(short), 1
        ids[1], mask[1] = torch.tensor(loud), 1
        together = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(alone[0], together[0], atol=1e-5)


def test_search_plan_keeps_the_most_sensitive_layer_first():
    model = _tiny_bert()
    target = "bert.encoder.layer.1.output.dense"
    x = torch.randint(5, 100, (4, 12))

    def scores(m: torch.nn.Module) -> list[list[float]]:
        with torch.inference_mode():
            out = torch.sigmoid(m(input_ids=x).logits)
        # The target layer is made the most sensitive: quantizing it costs 0.3 on every score.
        return (out + 0.3 * isinstance(m.get_submodule(target), RowwiseInt8Linear)).tolist()

    reference = scores(model)

    def passes(ref, got) -> bool:
        worst: float = max(abs(a - b) for ra, rb in zip(ref, got, strict=True) for a, b in zip(ra, rb, strict=True))
        return worst < 0.2

    plan, trace = search_plan(copy.deepcopy(model), scores, reference, passes)
    assert plan.keep_bf16 == [target]
    assert [len(t["kept"]) for t in trace] == [0, 1]
    assert [t["passed"] for t in trace] == [False, True]
    assert plan.keep_fp32 == list(KEEP_FP32_DEFAULT)
