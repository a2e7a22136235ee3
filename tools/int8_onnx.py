"""The ONNX Runtime side of `tools.int8_bench`: the fp32 export, its int8 variants (per-tensor,
per-row, SmoothQuant, static QDQ, MatMulNBits, mixed by MatMul role) and the greedy role search."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

from tools.int8_measure import no_context
from worker.gate.compare import compare
from worker.gate.fidelity import REDUCED_BUDGET
from worker.onnx_export import int8_graph as onnx_rowwise
from worker.onnx_export.artifacts import PER_TENSOR_INT8
from worker.onnx_export.build import check_against_torch, export_onnx, fold, fuse, quantize_int8


class OrtModel:
    """An ONNX Runtime graph behind the torch model's call signature (logits first), so every variant
    runs through the same `Runner`. One session per thread count: the gate and the timing differ."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sessions: dict[int, Any] = {}

    def session(self) -> Any:
        threads = torch.get_num_threads()
        if threads not in self._sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self._sessions[threads] = ort.InferenceSession(str(self.path), options,
                                                           providers=["CPUExecutionProvider"])
        return self._sessions[threads]

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        out = self.session().run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        return (torch.from_numpy(out[0]),)


def onnx_fp32(model: Any, tokenizer: Any, directory: Path) -> Path:
    """The export's fp32 graph (`worker.onnx_export.build`: dynamo export, fold, fuse), built once here."""
    path = directory / "model.onnx"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    work = copy.deepcopy(model)
    work.set_attn_implementation("eager")
    export_onnx(work, directory / "raw.onnx", cfg.vocab_size, tokenizer.pad_token_id)
    fold(directory / "raw.onnx", directory / "folded.onnx")
    fusions = fuse(directory / "folded.onnx", path, cfg.num_attention_heads, cfg.hidden_size)
    diff = check_against_torch(work, path, cfg.vocab_size, tokenizer.pad_token_id)
    print(f"onnx fp32 export: fusions {fusions}, max logit diff vs torch {diff:.2e}", flush=True)
    return path


def onnx_variants(model: Any, tokenizer: Any, directory: Path,
                  feeds: Callable[[], list[dict[str, np.ndarray]]]
                  ) -> dict[str, Callable[[], tuple[Any, Callable[[], Any]]]]:
    """ONNX Runtime recipes on the export's fp32 graph. `feeds()`: calibration batches (numpy)."""
    maxima: dict[str, np.ndarray] = {}

    def fp32() -> Path:
        return onnx_fp32(model, tokenizer, directory)

    def calibrated() -> dict[str, np.ndarray]:
        if not maxima:
            maxima.update(onnx_rowwise.activation_maxima(fp32(), feeds()))
        return maxima

    def plain() -> tuple[Any, Callable[[], Any]]:
        return OrtModel(fp32()), no_context

    def dynamic() -> tuple[Any, Callable[[], Any]]:
        quantize_int8(fp32(), directory / "dynamic-int8.onnx", PER_TENSOR_INT8)
        return OrtModel(directory / "dynamic-int8.onnx"), no_context

    def rowwise(alpha: float | None, keep: Sequence[str] = (), unsigned_gelu: bool = False, outliers: int = 0
                ) -> Callable[[], tuple[Any, Callable[[], Any]]]:
        def make() -> tuple[Any, Callable[[], Any]]:
            out = directory / (f"rowwise-{alpha}-{'-'.join(keep) or 'all'}{'-ugelu' if unsigned_gelu else ''}"
                               f"-o{outliers}.onnx")
            act_max = None if alpha is None and not outliers else calibrated()
            counts = onnx_rowwise.rowwise_int8(fp32(), out, act_max, alpha, keep, unsigned_gelu, outliers)
            print(f"  rowwise rewrite: {counts}", flush=True)
            return OrtModel(out), no_context
        return make

    def nbits8() -> tuple[Any, Callable[[], Any]]:
        config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=8)
        quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32())), algo_config=config)
        quantizer.process()
        out = directory / "nbits8-acc4.onnx"
        quantizer.model.save_model_to_file(str(out))
        return OrtModel(out), no_context

    def static_qdq() -> tuple[Any, Callable[[], Any]]:
        batches = iter(feeds())

        class Reader(CalibrationDataReader):  # type: ignore[misc]
            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(batches, None)

        out = directory / "static-qdq.onnx"
        quantize_static(str(fp32()), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul"])
        return OrtModel(out), no_context

    return {"onnx fp32": plain, "onnx-int8 (dynamic, per-tensor activations)": dynamic,
            "onnx static int8 QDQ (MinMax calibrated, per-channel)": static_qdq,
            "onnx rowwise int8 (MatMulInteger, per-row)": rowwise(None),
            "onnx rowwise int8 + SmoothQuant a=0.5": rowwise(0.5),
            "onnx rowwise int8 + SmoothQuant a=0.65": rowwise(0.65),
            "onnx rowwise int8 + SmoothQuant a=0.8": rowwise(0.8),
            "onnx rowwise int8 + SmoothQuant a=0.5 + uint8 GELU-out, no outlier channels": rowwise(0.5, (), True),
            "onnx rowwise int8 + uint8 GELU-out (no SmoothQuant)": rowwise(None, (), True),
            "onnx rowwise int8 + SmoothQuant a=0.5 + uint8 GELU-out, QKV fp32": rowwise(0.5, ("qkv",), True),
            "onnx rowwise int8 + SmoothQuant a=0.5 + uint8 GELU-out, FFN-in fp32": rowwise(0.5, ("ffn-in",), True),
            "onnx MatMulNBits 8-bit blk32, int8 compute (acc 4)": nbits8,
            **{f"onnx rowwise int8 + SmoothQuant a={a} + uint8 GELU-out + {k} outlier channels fp32":
               rowwise(a, (), True, k) for a in (0.5, 0.3, None) for k in (4, 8, 16, 32, 48, 64)},
            **{f"onnx rowwise int8 + SmoothQuant a=0.5 + uint8 GELU-out + 32 outlier channels, {role} fp32":
               rowwise(0.5, (role,), True, 32) for role in ("qkv", "attention-output", "ffn-in", "ffn-out")}}


def onnx_role_search(fp32: Path, directory: Path, alpha: float | None, act_max: dict[str, np.ndarray] | None,
                     scores_of: Callable[[Any], list[list[float]]], reference: Sequence[Sequence[float]]
                     ) -> tuple[list[str], list[dict[str, Any]]]:
    """Greedy mixed precision over MatMul roles (`worker.onnx_export.int8_graph.ROLES`): start with every role
    in fp32, then move to int8, one at a time, the role whose move keeps the gate passing with the
    smallest p99 error; stop when no move passes. Returns the roles left in fp32 and the trace."""
    present = sorted(set(onnx_rowwise.matmul_roles(onnx.load(str(fp32)).graph).values()))
    keep = list(present)
    trace: list[dict[str, Any]] = []
    while keep:
        trials = {}
        for role in keep:
            trial = [r for r in keep if r != role]
            out = directory / f"search-{'-'.join(trial) or 'none'}.onnx"
            onnx_rowwise.rowwise_int8(fp32, out, act_max, alpha, trial)
            c = compare(reference, scores_of(OrtModel(out)))
            trials[role] = c
            trace.append({"fp32": trial, "max_abs": c.max_abs, "p99_abs": c.p99_abs, "flips": c.flip_fraction,
                          "spearman": c.min_spearman, "passed": c.within(REDUCED_BUDGET)})
            print(f"  search: fp32 {trial}: {trace[-1]}", flush=True)
        passing = [r for r, c in trials.items() if c.within(REDUCED_BUDGET)]
        if not passing:
            break
        keep.remove(min(passing, key=lambda r: trials[r].p99_abs))
    return keep, trace
