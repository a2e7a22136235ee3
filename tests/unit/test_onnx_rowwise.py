"""The ONNX per-row int8 rewrite (`worker.onnx_export.int8_graph`) on a one-MatMul graph, run by ONNX Runtime:
what outlier channels in fp32 buy when one activation channel dwarfs the rest, and what GPTQ rounding buys
when the input channels move together."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cpu import needs_exact_int8
from worker.onnx_export.gptq import gptq_round
from worker.onnx_export.int8_graph import INT7_MAX, OUTLIER_SHARE, calibrate, quantize_columns, rowwise_int8

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

IN, OUT = 64, 32


def _linear(path: Path, weight: np.ndarray) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    out: np.ndarray = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return out


@pytest.fixture
def case(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(IN, OUT)).astype(np.float32)
    x = rng.normal(size=(200, IN)).astype(np.float32)
    x[:, [5, 40]] *= 60  # two LayerNorm-style outlier channels, in every row
    return _linear(tmp_path / "fp32.onnx", weight), weight, x, {"x": np.abs(x).max(axis=0)}


def test_outlier_channels_in_fp32_cut_the_error_of_every_row(tmp_path: Path, case) -> None:  # type: ignore[no-untyped-def]
    src, weight, x, act_max = case
    expected = x @ weight
    plain = rowwise_int8(src, tmp_path / "plain.onnx", act_max)
    split = rowwise_int8(src, tmp_path / "split.onnx", act_max, outliers=2)
    assert plain["outlier_gathers"] == 0 and split["outlier_gathers"] == 1
    plain_error = np.abs(_run(tmp_path / "plain.onnx", x) - expected).mean()
    split_error = np.abs(_run(tmp_path / "split.onnx", x) - expected).mean()
    assert split_error < plain_error / 10  # the other 62 channels get the whole int8 range back


def test_the_outlier_channels_product_is_exact_fp32(tmp_path: Path, case) -> None:  # type: ignore[no-untyped-def]
    """Only the chosen channels are non-zero: the int8 product sees zeros, the fp32 one all of it."""
    src, weight, x, act_max = case
    rowwise_int8(src, tmp_path / "split.onnx", act_max, outliers=2)
    only = np.zeros_like(x)
    only[:, [5, 40]] = x[:, [5, 40]]
    np.testing.assert_allclose(_run(tmp_path / "split.onnx", only), only @ weight, rtol=1e-5, atol=1e-4)


def test_outlier_channels_are_capped_and_need_the_calibration(tmp_path: Path, case) -> None:  # type: ignore[no-untyped-def]
    src, weight, x, act_max = case
    rowwise_int8(src, tmp_path / "capped.onnx", act_max, outliers=IN)
    model = onnx.load(str(tmp_path / "capped.onnx"))
    index = next(i for i in model.graph.initializer if i.name.endswith("_outliers_idx"))
    assert index.dims == [IN // OUTLIER_SHARE]
    with pytest.raises(ValueError, match="calibration"):
        rowwise_int8(src, tmp_path / "x.onnx", outliers=2)


@needs_exact_int8
def test_a_matmul_too_narrow_for_one_outlier_channel_keeps_all_in_int8(tmp_path: Path) -> None:
    narrow = OUTLIER_SHARE - 1
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(narrow, OUT)).astype(np.float32)
    x = rng.normal(size=(8, narrow)).astype(np.float32)
    src = _linear(tmp_path / "narrow.onnx", weight)
    counts = rowwise_int8(src, tmp_path / "q.onnx", {"x": np.abs(x).max(axis=0)}, outliers=4)
    assert counts["outlier_gathers"] == 0 and counts["matmuls"] == 1
    error = np.abs(_run(tmp_path / "q.onnx", x) - x @ weight).max()
    assert 0 < error < 0.1  # int8 really ran, on every channel


def _correlated(rng: np.random.Generator, rows: int, mix: np.ndarray) -> np.ndarray:
    """Inputs whose channels move together, as a transformer layer's do."""
    out: np.ndarray = (rng.normal(size=(rows, IN)) @ mix).astype(np.float32)
    return out


def test_gptq_rounding_errs_less_than_round_to_nearest_on_inputs_like_the_calibration(tmp_path: Path) -> None:
    """7-bit weights, so the products cannot saturate on any x86 CPU; the error is measured on rows the
    calibration never saw."""
    rng = np.random.default_rng(2)
    mix = rng.normal(size=(IN, IN)) / np.sqrt(IN) + np.eye(IN)
    weight = rng.normal(size=(IN, OUT)).astype(np.float32)
    src = _linear(tmp_path / "fp32.onnx", weight)
    seen, unseen = _correlated(rng, 400, mix), _correlated(rng, 300, mix)
    maxima, hessians = calibrate(src, [{"x": seen[:150]}, {"x": seen[150:]}], hessians=True)
    np.testing.assert_allclose(maxima["x"], np.abs(seen).max(axis=0))
    np.testing.assert_allclose(hessians["w"], seen.T @ seen, rtol=1e-4, atol=1e-2)
    rowwise_int8(src, tmp_path / "rtn.onnx", weight_levels=INT7_MAX)
    rowwise_int8(src, tmp_path / "gptq.onnx", weight_levels=INT7_MAX, hessians=hessians)
    expected = unseen @ weight
    rtn = np.linalg.norm(_run(tmp_path / "rtn.onnx", unseen) - expected)
    gptq = np.linalg.norm(_run(tmp_path / "gptq.onnx", unseen) - expected)
    assert gptq < 0.92 * rtn  # 0.84-0.88 over seeds 2-7; the per-row activation rounding is common to both


def test_gptq_keeps_the_range_and_zeroes_channels_no_input_reaches() -> None:
    rng = np.random.default_rng(3)
    weight = rng.normal(size=(IN, OUT)).astype(np.float32)
    x = rng.normal(size=(100, IN))
    x[:, 7] = 0.0  # a channel the rewrite zeroed (an outlier channel): nothing to weigh its rounding by
    nearest, scale = quantize_columns(weight, INT7_MAX)
    q = gptq_round(weight, x.T @ x, scale, INT7_MAX)
    assert q.dtype == np.int8 and np.abs(q).max() <= INT7_MAX
    assert not q[7].any() and q[6].any()
    assert (q != nearest).any()  # the errors it carried changed some roundings
