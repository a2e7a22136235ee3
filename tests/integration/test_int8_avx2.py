"""`onnx-int8-w7`, the int8 graph for CPUs without int8 dot products: built by the export beside
`onnx-int8`, loaded and scored through real ONNX Runtime, covered by the decision's recorded recipe,
and free of the int16 pair saturation that `vpmaddubsw` inflicts on `onnx-int8`: shown by a numpy
emulation, and on ONNX Runtime's own AVX2 kernels under `tools.avx2_host` where this CPU allows it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from testing import MODELS, ROOT
from tools.int8_avx2 import emulate_saturation
from worker.backends.base import REDUCED
from worker.backends.loader import load_backend
from worker.backends.registry import int8_dot_products
from worker.cpus import cpu_flags
from worker.gate.decision import Decision
from worker.gate.fidelity import REDUCED_BUDGET, gate_texts, run_gate
from worker.onnx_export import build
from worker.onnx_export.artifacts import (
    DEFAULT_INT8,
    INT8_MODEL,
    INT8_U8_MODEL,
    INT8_W7_MODEL,
    export_location,
    int8_records,
    verify_export,
)
from worker.onnx_export.int8_graph import int8_matmuls
from worker.settings import WorkerSettings


def _matmul_integer_weights(path: Path) -> list[np.ndarray]:
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    return [numpy_helper.to_array(inits[n.input[1]]) for n in int8_matmuls(model.graph)]


def test_export_builds_a_seven_bit_weight_graph_beside_the_int8_one(exported: WorkerSettings) -> None:
    """The export holds both int8 graphs, hashed in the manifest; the w7 graph quantizes the same
    MatMuls with weights in [-63, 63] (the 8-bit graph's reach +-127)."""
    directory, sha = export_location(exported)
    manifest = verify_export(directory, sha)
    assert {INT8_MODEL, INT8_W7_MODEL, INT8_U8_MODEL} <= set(manifest.files)
    eight, seven = _matmul_integer_weights(directory / INT8_MODEL), _matmul_integer_weights(directory / INT8_W7_MODEL)
    assert len(seven) == len(eight) > 0
    assert max(int(np.abs(w).max()) for w in eight) == 127
    assert max(int(np.abs(w).max()) for w in seven) == 63


def test_w7_backend_loads_and_scores_through_onnx_runtime(exported: WorkerSettings) -> None:
    """`onnx-int8-w7` loads the w7 graph by its registry name and precision and scores like a backend:
    one probability per label per text, and the gate gives it a measured row (its own graph, not the
    8-bit one: the two score differently)."""
    backend = load_backend("onnx-int8-w7", exported)
    assert (backend.name, backend.precision) == ("onnx-int8-w7", REDUCED)
    texts = ["you are lovely", "You are an idiot!!!", "word " * 600]
    scores = backend.predict(backend.tokenize(texts))
    assert len(scores) == len(texts) and all(len(row) == len(backend.labels) for row in scores)
    assert all(0.0 <= p <= 1.0 and math.isfinite(p) for row in scores for p in row)
    eight = load_backend("onnx-int8", exported)
    assert eight.predict(eight.tokenize(texts)) != scores
    rows = run_gate(exported, ["onnx-int8-w7"], gate_texts(32), judge=["onnx-int8-w7"])  # judged even if slower
    assert rows[1].backend == "onnx-int8-w7" and rows[1].error is None and rows[1].texts_per_s > 0


def test_seven_bit_weights_avoid_the_int16_pair_saturation_in_emulation(exported: WorkerSettings) -> None:
    """NUMPY EMULATION of `vpmaddubsw` on each graph's real int8 product inputs: the 8-bit graph has
    pairs of products beyond int16 (the fault AVX2 CPUs hit), the 7-bit-weight graph has none."""
    directory, _ = export_location(exported)
    backend = load_backend("onnx", exported)
    feeds = build.calibration_feeds(backend._tokenizer, gate_texts(6)[1:])  # type: ignore[attr-defined]
    eight = emulate_saturation(directory / INT8_MODEL, feeds)
    seven = emulate_saturation(directory / INT8_W7_MODEL, feeds)
    assert eight["saturated_pairs"] > 0 and eight["max_int32_error"] > 0
    assert seven["pairs"] == eight["pairs"] and seven["saturated_pairs"] == 0 and seven["wrong_outputs"] == 0
    assert seven["max_activation_u8"] > 200  # the same 8-bit activations: only the weights changed


def test_decision_records_both_int8_graphs_recipes(exported: WorkerSettings) -> None:
    """A decision gated both int8 graphs, so it records both recipes; one that records only the 8-bit
    graph's (made before the w7 graph existed) is not trusted."""
    directory, sha = export_location(exported)
    decision = Decision(checkpoint_sha256=sha, chosen="onnx", rows=[], threads=1, texts=8)
    assert decision.int8_recipe == int8_records()
    assert decision.int8_recipe[INT8_W7_MODEL]["reduce_range"] is True
    assert decision.invalid_because(sha) is None
    decision.int8_recipe = DEFAULT_INT8.record()
    assert "int8 recipe" in (decision.invalid_because(sha) or "")


def trained_checkpoint() -> tuple[Path, Path]:
    """(model.ckpt, hf/) of the trained MiniLM (`make models/trained/model.ckpt`; built here if missing)."""
    ckpt = MODELS / "trained" / "model.ckpt"
    if not ckpt.is_file():
        subprocess.run([sys.executable, "-m", "tools.trained", "--out", str(MODELS)], check=True, cwd=ROOT)
    return ckpt, ckpt.parent / "hf"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the export, the reference and three int8 graphs on 1,024 texts: >10 min on 2 shared cores
def test_int8_graphs_gate_rows_on_the_trained_checkpoint(tmp_path: Path) -> None:
    """On trained weights and the full gate corpus: `onnx-int8-u8` scores exactly as `onnx-int8` where the
    CPU has int8 dot products (so it passes wherever that does), and better than it where `onnx-int8`
    saturates; `onnx-int8-w7` stays within the p99 budget (7-bit weights cost resolution: p99 1.4-1.9x
    `onnx-int8`'s, and before GPTQ its max reached 0.059 on one rebuild, docs/int8-recipes.md); flips decide
    per checkpoint."""
    ckpt, hf = trained_checkpoint()
    settings = WorkerSettings(checkpoint=ckpt, hf_config=hf, export_dir=tmp_path)
    build.ensure_export(settings)
    rows = {row.backend: row for row in run_gate(settings, ["onnx-int8", "onnx-int8-u8", "onnx-int8-w7"], full=True)}
    eight, u8, w7 = rows["onnx-int8"], rows["onnx-int8-u8"], rows["onnx-int8-w7"]
    assert all(row.error is None for row in (eight, u8, w7))
    if int8_dot_products(cpu_flags()):
        assert (u8.max_abs, u8.p99_abs, u8.flips, u8.passed) == (eight.max_abs, eight.p99_abs, eight.flips,
                                                                 eight.passed)
    else:  # here onnx-int8's pairs of products saturate in int16 and the U8U8 kernels' do not
        assert u8.p99_abs < eight.p99_abs, (u8, eight)
    assert w7.p99_abs <= REDUCED_BUDGET.p99_abs, w7


def test_u8_backend_computes_exactly_what_onnx_int8_computes(exported: WorkerSettings) -> None:
    """`onnx-int8-u8` stores `onnx-int8`'s weights as uint8 (zero point 128): the same integer products
    on ONNX Runtime's U8U8 kernels, so the same scores, while its graph holds no int8 weight."""
    directory, _ = export_location(exported)
    model = onnx.load(str(directory / INT8_U8_MODEL))
    inits = {i.name: i.data_type for i in model.graph.initializer}
    kinds = {inits[n.input[1]] for n in int8_matmuls(model.graph)}
    assert kinds == {onnx.TensorProto.UINT8}
    u8, eight = load_backend("onnx-int8-u8", exported), load_backend("onnx-int8", exported)
    assert (u8.name, u8.precision) == ("onnx-int8-u8", REDUCED)
    if not int8_dot_products(cpu_flags()):
        pytest.skip("this CPU has no int8 dot products: onnx-int8's products saturate here, so it is no exact "
                    "reference (the AVX2 stand-in test compares the two on a CPU with them)")
    texts = gate_texts(24)
    got = np.array(u8.predict(u8.tokenize(texts)))
    expected = np.array(eight.predict(eight.tokenize(texts)))
    assert np.abs(got - expected).max() < 1e-6


def _avx2_host_or_skip() -> None:
    from tools.avx2_host.__main__ import unavailable
    why = unavailable()
    if why:
        pytest.skip(f"no AVX2 stand-in here: {why}")


SCORE_GRAPHS = """
import json, sys
from worker.backends.loader import load_backend
from worker.gate.fidelity import gate_texts
from worker.settings import WorkerSettings
settings = WorkerSettings(checkpoint=sys.argv[1], hf_config=sys.argv[2], export_dir=sys.argv[3])
texts = gate_texts(48)
out = {}
for name in ("onnx", "onnx-int8", "onnx-int8-w7", "onnx-int8-u8"):
    backend = load_backend(name, settings)
    out[name] = backend.predict(backend.tokenize(texts))
print(json.dumps(out))
"""
"""Scores of the gate's first texts by each ONNX graph, as JSON: run here and on the AVX2 stand-in."""


def _scores(exported: WorkerSettings, avx2: bool) -> dict[str, np.ndarray]:
    paths = (exported.checkpoint, exported.hf_config, exported.export_dir)
    argv = [sys.executable, "-c", SCORE_GRAPHS, *map(str, paths)]
    if avx2:
        argv = [sys.executable, "-m", "tools.avx2_host", "--", *argv]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return {name: np.array(rows) for name, rows in json.loads(done.stdout.splitlines()[-1]).items()}


def test_the_avx2_stand_in_shows_every_library_a_cpu_without_avx512_or_vnni() -> None:
    """Under `tools.avx2_host` the worker's kernel signature, ATen's dispatch and ONNX Runtime's int8 GEMM
    all see AVX2 only: 255 x 127 products summed in pairs saturate, as they do on an AVX2-only CPU."""
    _avx2_host_or_skip()
    done = subprocess.run([sys.executable, "-m", "tools.avx2_host", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kernel signature: avx2\n" in done.stdout and "torch CPU capability: AVX2\n" in done.stdout, done.stdout
    assert "saturating int16 pairs" in done.stdout, done.stdout


@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler"])
def test_a_real_fault_under_the_stand_in_still_ends_the_process(faulthandler: bool) -> None:
    """The shim traps CPUID only: a program's own segmentation fault still kills it (and reaches its
    own handler first, here Python's faulthandler), instead of looping in the shim's handler."""
    _avx2_host_or_skip()
    options = ["-X", "faulthandler"] if faulthandler else []
    crash = [sys.executable, *options, "-c", "import ctypes; ctypes.string_at(0)"]
    done = subprocess.run([sys.executable, "-m", "tools.avx2_host", "--", *crash], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode in (-11, 139), (done.returncode, done.stderr)
    assert ("Fatal Python error: Segmentation fault" in done.stderr) is faulthandler, done.stderr


@pytest.mark.slow
def test_on_real_avx2_kernels_w7_and_u8u8_score_as_with_vnni_and_int8_does_not(exported: WorkerSettings) -> None:
    """ONNX Runtime's own AVX2 kernels, not an emulation: the 7-bit-weight and U8U8 graphs cannot
    saturate, so they give this CPU's scores (to float rounding of the fp32 ops around the GEMMs), while
    `onnx-int8`'s u8 x s8 pairs saturate and its scores move far more."""
    _avx2_host_or_skip()
    if not int8_dot_products(cpu_flags()):
        pytest.skip("this CPU has no int8 dot products itself: both runs would saturate alike")
    here, avx2 = _scores(exported, avx2=False), _scores(exported, avx2=True)
    moved = {name: float(np.abs(here[name] - avx2[name]).max()) for name in here}
    assert moved["onnx"] < 1e-5 and moved["onnx-int8-w7"] < 1e-4 and moved["onnx-int8-u8"] < 1e-4, moved
    assert moved["onnx-int8"] > 100 * max(moved["onnx-int8-w7"], moved["onnx-int8-u8"], 1e-6), moved
