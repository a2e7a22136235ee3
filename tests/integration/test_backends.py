"""Backends and the fidelity gate on the tiny checkpoint: a real ONNX export, real ONNX Runtime."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from testing import ROOT, start_worker
from tests.cpu import lift_speed_refusals, needs_exact_int8
from tests.deploy.deployfiles import parse_dockerfile, shell_commands
from worker import export
from worker.backends.compiled import COMPILER_ENV, WARM_UP_BATCHES, TorchBf16CompiledBackend, TorchCompiledBackend
from worker.backends.reduced import TorchBf16Backend
from worker.cpus import cpu_flags, kernel_signature
from worker.gate.compare import compare
from worker.gate.fidelity import (
    FP32_BUDGET,
    REDUCED_BUDGET,
    SPEED_BATCH,
    SPEED_TEXTS,
    gate_texts,
    measure,
    run_gate,
    score,
    speed,
)
from worker.onnx_export import artifacts, build
from worker.onnx_export.artifacts import ExportError
from worker.onnx_export.int8_graph import INT8_MATMUL
from worker.settings import WorkerSettings


def another_cpu() -> str:
    """A kernel signature that is not this machine's, whatever this machine is."""
    return "avx2" if kernel_signature() != "avx2" else "avx2,avx512_vnni"


@pytest.fixture(scope="module")
def reference(exported: WorkerSettings) -> tuple[list[str], list[list[float]], list[str]]:
    """Gate texts and the torch reference's scores of them."""
    from worker.backends.loader import load_backend

    texts = gate_texts(96)
    backend = load_backend("torch", exported)
    return texts, score(backend, texts, exported), backend.labels


def _copy_export(settings: WorkerSettings, tmp_path: Path) -> tuple[WorkerSettings, Path]:
    directory, _ = artifacts.export_location(settings)
    target = tmp_path / "exports" / directory.name
    shutil.copytree(directory, target)
    return settings.model_copy(update={"export_dir": tmp_path / "exports"}), target


def test_export_manifest_records_hash_versions_and_files(exported: WorkerSettings) -> None:
    """The export sits under the checkpoint's sha256 and its manifest hashes every file it holds."""
    directory, sha = artifacts.export_location(exported)
    assert directory.name == sha == artifacts.sha256_file(exported.checkpoint)  # type: ignore[arg-type]
    manifest = artifacts.verify_export(directory, sha)
    assert {artifacts.FP32_MODEL, artifacts.INT8_MODEL} <= set(manifest.files)
    assert any(name.startswith(artifacts.TOKENIZER_DIR + "/") for name in manifest.files)
    assert manifest.versions["onnxruntime"] and manifest.versions["torch"] and manifest.opset >= 17
    assert manifest.labels[0] == "toxicity" and manifest.num_outputs == 16


def test_onnx_scores_like_torch_with_the_same_json(exported: WorkerSettings) -> None:
    """The ONNX backend returns the torch path's labels in its order, with probabilities within 1e-4."""
    from worker.backends.loader import load_backend
    from worker.scorer import Scorer

    texts = gate_texts(40)
    torch_rows, _ = Scorer(load_backend("torch", exported), 1024, 16).score(texts)
    onnx_backend = load_backend("onnx", exported)
    onnx_rows, _ = Scorer(onnx_backend, 1024, 16).score(texts)
    assert onnx_backend.name == "onnx" and onnx_backend.load_seconds > 0
    for t, o in zip(torch_rows, onnx_rows, strict=True):
        assert list(t) == list(o)
        assert all(isinstance(v, float) for v in o.values())
        assert max(abs(t[k] - o[k]) for k in t) <= 1e-4


def test_onnx_backend_scores_long_texts_in_windows_like_torch(exported: WorkerSettings) -> None:
    """long_text="windows" works on the ONNX backend too: the same windows as torch (its saved
    tokenizer), the same max-over-windows scores within 1e-4."""
    from fleet.corpus import CommentCorpus
    from worker.backends.loader import load_backend
    from worker.scorer import Scorer

    texts = [" ".join(CommentCorpus(9).texts(40)), "short"]
    torch_backend = load_backend("torch", exported)
    onnx_backend = load_backend("onnx", exported)
    assert onnx_backend.tokenize_windows(texts) == torch_backend.tokenize_windows(texts)
    assert len(onnx_backend.tokenize_windows(texts)[0]) > 2
    torch_rows, _ = Scorer(torch_backend, 1024, 16).score(texts, "windows")
    onnx_rows, _ = Scorer(onnx_backend, 1024, 16).score(texts, "windows")
    for t, o in zip(torch_rows, onnx_rows, strict=True):
        assert max(abs(t[k] - o[k]) for k in t) <= 1e-4


def test_gate_passes_onnx_fp32_and_checks_the_reference(exported: WorkerSettings) -> None:
    """On the tiny checkpoint the fp32 ONNX export is within 1e-4 of torch on padded passes, and the
    reference's padded passes equal its unpadded scores."""
    rows = run_gate(exported, ["onnx"], gate_texts(96), judge=["onnx"])
    by_name = {row.backend: row for row in rows}
    assert by_name["torch"].passed and by_name["torch"].max_abs <= FP32_BUDGET.max_abs
    assert by_name["onnx"].passed, by_name["onnx"]
    assert by_name["onnx"].max_abs <= FP32_BUDGET.max_abs and by_name["onnx"].flips == 0


def test_gate_times_backends_in_worker_sized_batches(exported: WorkerSettings) -> None:
    """The gate's texts/s comes from batches of `SPEED_BATCH` texts in corpus order, each planned into
    passes with the backend's own cost of a pass, as a worker under load scores them; not from the
    whole corpus sorted at once, the shape its fidelity passes have (issue 11)."""
    from worker.backends.loader import load_backend

    backend = load_backend("torch", exported)
    texts = gate_texts(SPEED_TEXTS + 40)
    passes: list[int] = []
    predict = backend.predict

    def recording(batch: Sequence[Sequence[int]]) -> list[list[float]]:
        passes.append(len(batch))
        return predict(batch)

    backend.predict = recording  # type: ignore[method-assign]
    score(backend, texts, exported)
    assert max(passes) > SPEED_BATCH  # the fidelity passes: the corpus sorted into full passes
    passes.clear()
    rate = speed(backend, texts, exported)  # its first passes: the one-text probes of a pass's cost
    assert rate > 0 and max(passes) <= SPEED_BATCH and sum(passes) >= SPEED_TEXTS + SPEED_BATCH


def test_gate_applies_the_reduced_budget_to_quantized_backends(exported: WorkerSettings) -> None:
    """int8 backends are measured against the 0.02 / 1 % budget and pass exactly when within it (every
    text judged, whatever their speed: `full`)."""
    rows = run_gate(exported, ["onnx-int8", "torch-int8"], gate_texts(64), full=True)
    for row in rows[1:]:
        assert row.precision == "reduced" and row.error is None
        assert row.budget_max_abs == REDUCED_BUDGET.max_abs
        assert math.isfinite(row.max_abs) and row.max_abs > 0  # int8 really computes differently
        assert row.passed == (row.max_abs <= 0.02 and row.flip_fraction <= 0.01)


def test_int8_export_is_per_row_with_smoothquant_as_the_manifest_records(exported: WorkerSettings) -> None:
    """The export's int8 graph is the default recipe: per-row int8 products with SmoothQuant factors and
    outlier channels in fp32, no per-tensor DynamicQuantizeLinear, every Linear MatMul rewritten; the
    manifest records it."""
    import onnx

    directory, sha = artifacts.export_location(exported)
    manifest = artifacts.verify_export(directory, sha)
    assert manifest.int8 == artifacts.DEFAULT_INT8.record()
    assert manifest.int8["activations"] == artifacts.PER_ROW and manifest.int8["smooth_alpha"] is not None
    nodes = onnx.load(str(directory / artifacts.INT8_MODEL)).graph.node
    ops = [n.op_type for n in nodes if not n.name.endswith("_outlier_mm")]
    fp32_matmuls = [n for n in onnx.load(str(directory / artifacts.FP32_MODEL)).graph.node
                    if n.op_type == "MatMul"]
    assert "DynamicQuantizeLinear" not in ops and "MatMulInteger" not in ops
    assert ops.count(INT8_MATMUL) > 0 and ops.count("MatMul") + ops.count(INT8_MATMUL) == len(fp32_matmuls)
    # Each int8 product has its outlier channels' fp32 product beside it (one Gather per input tensor).
    assert sum(n.name.endswith("_outlier_mm") for n in nodes) == ops.count(INT8_MATMUL)
    assert manifest.int8["outlier_channels"] > 0
    constants = [i.name for i in onnx.load(str(directory / artifacts.INT8_MODEL)).graph.initializer]
    assert any(n.startswith("rowwise_") and n.endswith("_inv_smooth") for n in constants)
    # The FFN outputs' rows (GELU, >= -0.17) are shifted into uint8, the shift's product taken back out.
    assert sum(n.endswith("_shift_product") for n in constants) == 2  # the tiny ALBERT's 2 FFN-out MatMuls


@needs_exact_int8
def test_per_row_onnx_graph_computes_what_the_torch_rowwise_module_computes(exported: WorkerSettings,
                                                                            tmp_path: Path) -> None:
    """Without smoothing, the ONNX per-row rewrite and `worker.backends.rowwise` (pooler included,
    classifier fp32: the export's Gemm nodes stay fp32 too) give the same logits: same rounding."""
    import copy

    import onnxruntime as ort
    import torch

    from worker.backends.rowwise import QuantPlan, apply_plan
    from worker.onnx_export.int8_graph import rowwise_int8
    from worker.weights import load_detoxify

    directory, _ = artifacts.export_location(exported)
    rowwise_int8(directory / artifacts.FP32_MODEL, tmp_path / "rw.onnx")
    model = load_detoxify(exported).model.eval()
    rng = np.random.default_rng(3)
    ids = rng.integers(5, model.config.vocab_size - 1, (3, 24))
    mask = np.ones_like(ids)
    ids[1, 9:], mask[1, 9:] = 0, 0
    keep = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "pooler" in n]
    quantized = apply_plan(copy.deepcopy(model), QuantPlan(keep_fp32=["classifier", *keep]))
    with torch.inference_mode():
        expected = quantized(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))[0].numpy()
        fp32 = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))[0].numpy()
    got = ort.InferenceSession(str(tmp_path / "rw.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids, "attention_mask": mask})[0]
    assert np.abs(got - fp32).max() > 1e-3  # int8 really computes differently
    assert np.abs(got - expected).max() <= 1e-4


def test_per_row_int8_scores_a_text_the_same_whatever_shares_its_pass(exported: WorkerSettings,
                                                                     tmp_path: Path) -> None:
    """The point of per-row scales: a text scored beside a long, different text (one padded pass)
    scores as it does alone, while per-tensor dynamic int8 (ONNX Runtime's quantizer, the earlier
    recipe) lets the neighbour move it."""
    from worker.backends.loader import load_backend
    from worker.backends.onnx import OnnxBackend

    def moved(backend: OnnxBackend) -> float:
        text, neighbour = backend.tokenize(["a short comment, thanks for sharing", "word " * 300 + "!!! ???"])
        alone, beside = backend.predict([text])[0], backend.predict([text, neighbour])[0]
        return max(abs(a - b) for a, b in zip(alone, beside, strict=True))

    per_row = load_backend("onnx-int8", exported)
    assert isinstance(per_row, OnnxBackend) and moved(per_row) <= 1e-4
    directory, sha = artifacts.export_location(exported)
    build.quantize_int8(directory / artifacts.FP32_MODEL, tmp_path / "per-tensor.onnx",
                        artifacts.PER_TENSOR_INT8)
    per_tensor = OnnxBackend(directory, artifacts.verify_export(directory, sha), tmp_path / "per-tensor.onnx", 1)
    assert moved(per_tensor) > 100 * moved(per_row) + 1e-3


def test_int8_export_of_another_recipe_is_refused_with_the_command(exported: WorkerSettings, tmp_path: Path) -> None:
    """A worker refuses an int8 graph its manifest says another recipe built (the per-tensor one of
    earlier exports, say), naming the command that rebuilds it; the fp32 graph still loads, and the
    export command rebuilds such an export."""
    from worker.backends.loader import load_backend
    from worker.gate.selection import check_backend

    settings, directory = _copy_export(exported, tmp_path)
    manifest = json.loads((directory / artifacts.MANIFEST_FILE).read_text())
    manifest["int8"] = artifacts.PER_TENSOR_INT8.record()
    (directory / artifacts.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"stale.*recipe.*python -m worker\.export"):
        load_backend("onnx-int8", settings)
    with pytest.raises(ExportError, match=r"stale.*recipe"):
        check_backend(settings.model_copy(update={"backend": "onnx-int8"}))
    assert load_backend("onnx", settings).name == "onnx"


def _recipe_backend(settings: WorkerSettings, softmax: bool, mask: bool):  # type: ignore[no-untyped-def]
    """The ONNX backend with the circulating recipe's mistakes switched on."""
    from worker.backends.onnx import OnnxBackend

    directory, sha = artifacts.export_location(settings)
    manifest = artifacts.verify_export(directory, sha)

    class Recipe(OnnxBackend):
        def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
            logits = self.logits(batch, with_mask=mask)[:, : len(self.labels)].astype(np.float64)
            if softmax:
                e = np.exp(logits - logits.max(axis=1, keepdims=True))
                probs = e / e.sum(axis=1, keepdims=True)
            else:
                probs = 1 / (1 + np.exp(-logits))
            out: list[list[float]] = probs.tolist()
            return out

    return Recipe(directory, manifest, artifacts.FP32_MODEL, 1)


@pytest.mark.parametrize(("softmax", "mask"), [(True, False), (True, True), (False, False)],
                         ids=["softmax+ids-only", "softmax", "ids-only"])
def test_gate_rejects_the_circulating_onnx_recipe(exported: WorkerSettings, reference, softmax: bool,  # type: ignore[no-untyped-def]
                                                  mask: bool) -> None:
    """Softmax across labels and/or feeding only input_ids (no attention mask) fails the gate, each alone."""
    texts, ref_scores, labels = reference
    row = measure(_recipe_backend(exported, softmax, mask), texts, ref_scores, labels, exported)
    assert not row.passed
    assert row.max_abs > 100 * FP32_BUDGET.max_abs


def test_gate_row_for_the_correct_backend_passes(exported: WorkerSettings, reference) -> None:  # type: ignore[no-untyped-def]
    """The same harness with sigmoid and the mask passes, so the failures above are the mistakes'."""
    texts, ref_scores, labels = reference
    assert measure(_recipe_backend(exported, False, True), texts, ref_scores, labels, exported).passed


def test_compare_counts_texts_with_any_flipped_label() -> None:
    """A text counts once however many of its labels cross 0.5; the max diff is over all labels."""
    ref = [[0.1, 0.9], [0.49, 0.51], [0.3, 0.3]]
    got = [[0.6, 0.4], [0.49, 0.51], [0.3, 0.35]]
    c = compare(ref, got)
    assert c.flips == 1 and c.max_abs == pytest.approx(0.5)


def test_corrupt_export_is_refused_with_the_command(exported: WorkerSettings, tmp_path: Path) -> None:
    """A model file whose bytes changed is refused at load, naming the command that rebuilds it."""
    from worker.backends.loader import load_backend

    settings, directory = _copy_export(exported, tmp_path)
    model = directory / artifacts.INT8_MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"corrupt.*python -m worker\.export"):
        load_backend("onnx-int8", settings)
    # The fp32 backend reads other files and still loads.
    assert load_backend("onnx", settings).name == "onnx"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("format", 0, "format"), ("checkpoint_sha256", "0" * 64, "checkpoint"),
    ("versions", {"onnxruntime": "1.0.0", "transformers": "1.0.0"}, "onnxruntime 1.0.0")])
def test_stale_export_is_refused(exported: WorkerSettings, tmp_path: Path, field: str, value: object,
                                 message: str) -> None:
    """An export of another format, checkpoint or onnxruntime version is stale: refused, not loaded."""
    from worker.backends.loader import load_backend

    settings, directory = _copy_export(exported, tmp_path)
    manifest = json.loads((directory / artifacts.MANIFEST_FILE).read_text())
    manifest[field] = value
    (directory / artifacts.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=f"stale.*{message}"):
        load_backend("onnx", settings)


def test_missing_export_is_refused_and_never_built_by_a_worker(tiny_checkpoint: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    """A worker asked for ONNX without an export refuses; it does not export at load time."""
    from worker.backends.loader import load_backend

    settings = WorkerSettings(checkpoint=tiny_checkpoint[0], hf_config=tiny_checkpoint[1], export_dir=tmp_path,
                              backend="onnx")
    with pytest.raises(ExportError, match=r"no export.*python -m worker\.export"):
        load_backend(settings.backend, settings)
    assert list(tmp_path.iterdir()) == []


def test_ensure_export_rebuilds_a_corrupt_export(exported: WorkerSettings, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The export command keeps a current export and rebuilds a corrupt one (the build itself is stubbed)."""
    settings, directory = _copy_export(exported, tmp_path)
    built: list[Path] = []

    def fake_build(_settings: WorkerSettings, _recipe: artifacts.Int8Recipe, target: Path) -> Path:
        built.append(target)
        return target

    monkeypatch.setattr(build, "build_export", fake_build)
    assert build.ensure_export(settings) == directory and built == []
    (directory / artifacts.FP32_MODEL).write_bytes(b"not a model")
    assert build.ensure_export(settings) == directory and built == [directory]


def test_auto_uses_a_valid_decision_and_falls_back_to_the_reference(exported: WorkerSettings, tmp_path: Path) -> None:
    """`auto` runs the gate's choice while checkpoint, int8 recipe, CPU flags and versions match; otherwise torch."""
    from worker.gate.decision import Decision
    from worker.gate.selection import resolve_backend

    settings, directory = _copy_export(exported, tmp_path)
    auto = settings.model_copy(update={"backend": "auto"})
    name, why = resolve_backend(auto)
    assert name == "torch" and "no fidelity decision" in why
    sha = directory.name
    Decision(checkpoint_sha256=sha, chosen="onnx", rows=[{"backend": "onnx", "texts_per_s": 9.0}], threads=1,
             texts=10).write(directory)
    assert resolve_backend(auto)[0] == "onnx"
    assert resolve_backend(settings.model_copy(update={"backend": "torch-int8"}))[0] == "torch-int8"
    Decision(checkpoint_sha256=sha, chosen="onnx", rows=[], threads=1, texts=10,
             kernel_signature=another_cpu()).write(directory)
    name, why = resolve_backend(auto)
    assert name == "torch" and "CPU" in why
    # A decision gated on another int8 recipe's graph (here the per-tensor one) no longer holds, whatever it chose.
    Decision(checkpoint_sha256=sha, chosen="onnx", rows=[], threads=1, texts=10,
             int8_recipe=artifacts.PER_TENSOR_INT8.record()).write(directory)
    name, why = resolve_backend(auto)
    assert name == "torch" and "int8 recipe" in why


def test_export_command_gate_writes_the_decision(exported: WorkerSettings, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m worker.export` on a current export runs the gate, prints the table, records a passing choice."""
    from worker.gate.decision import Decision

    settings, directory = _copy_export(exported, tmp_path)
    monkeypatch.setenv("TOXFLEET_CHECKPOINT", str(settings.checkpoint))
    monkeypatch.setenv("TOXFLEET_HF_CONFIG", str(settings.hf_config))
    monkeypatch.setenv("TOXFLEET_EXPORT_DIR", str(settings.export_dir))
    assert export.main(["--texts", "48", "--backends", "onnx,onnx-int8,torch-int8"]) == 0
    out = capsys.readouterr().out
    assert "| onnx | fp32 |" in out and "auto -> " in out
    decision = Decision.read(directory)
    assert [r["backend"] for r in decision.rows] == ["torch", "onnx", "onnx-int8", "torch-int8"]
    passed = [r for r in decision.rows if r["passed"]]
    assert decision.chosen == max(passed, key=lambda r: r["texts_per_s"])["backend"]
    assert export.main(["--check"]) == 0


def test_export_command_refuses_an_unknown_backend_before_exporting(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in `--backends` is a usage error naming the candidates, raised before any export starts."""
    with pytest.raises(SystemExit) as exit_info:
        export.main(["--out", str(tmp_path / "exports"), "--backends", "onnx,onnx_int8"])
    assert exit_info.value.code == 2
    assert "onnx_int8: not among torch-compiled," in capsys.readouterr().err
    assert not (tmp_path / "exports").exists()


def test_onnx_backend_runs_without_torch(exported: WorkerSettings) -> None:
    """The ONNX backend loads and scores in a process where importing torch fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from worker.settings import WorkerSettings\n"
        "from worker.backends.loader import load_backend\n"
        "from worker.scorer import Scorer\n"
        f"s = WorkerSettings(checkpoint={str(exported.checkpoint)!r}, hf_config={str(exported.hf_config)!r}, "
        f"export_dir={str(exported.export_dir)!r}, backend='onnx-int8')\n"
        "rows, _ = Scorer(load_backend(s.backend, s), 1024, 16).score(['hello there', 'you are awful'])\n"
        "assert len(rows) == 2 and len(rows[0]) == 7, rows\n"
        "print('ok', sorted(m for m in sys.modules if m.startswith('torch') and sys.modules[m] is not None))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok []"


def test_unknown_backend_name_is_rejected() -> None:
    """A typo in TOXFLEET_BACKEND fails at settings time, listing the known backends."""
    with pytest.raises(ValueError, match="onnx-int8"):
        WorkerSettings(backend="onnx_int8")


def test_kernel_signature_keeps_only_kernel_relevant_flags(tmp_path: Path) -> None:
    """The decision key lists the ISA flags that change kernels, in a fixed order, and ignores the rest."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 amx_int8 avx2 avx512_vnni hypervisor\n")
    assert kernel_signature(cpu_flags(cpuinfo)) == "avx2,avx512_vnni,amx_int8"
    assert kernel_signature(set()) == "baseline"


def _private_checkpoint(tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """The tiny checkpoint copied under tmp_path, so that exports next to it (the image's layout, no
    TOXFLEET_EXPORT_DIR) stay there; its hf/ directory is read where it is."""
    ckpt = tmp_path / "tiny" / "model.ckpt"
    ckpt.parent.mkdir()
    shutil.copyfile(tiny_checkpoint[0], ckpt)
    return ckpt.resolve(), tiny_checkpoint[1]


def _worker_log(tmp_path: Path, redis_url: str, checkpoint: tuple[Path, Path], name: str) -> str:
    """Start a real worker with default settings (no TOXFLEET_BACKEND), wait until it is ready, stop it."""
    worker = start_worker(tmp_path, redis_url, checkpoint, name=name, concurrency=1)
    try:
        return worker.output()
    finally:
        worker.stop()


def test_default_worker_without_a_decision_runs_torch_and_says_why(tiny_checkpoint: tuple[Path, Path],
                                                                    tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A real worker with default settings (`auto`) and no export next to its checkpoint runs the torch
    reference, logs why in its main and pool processes, and exports nothing."""
    checkpoint = _private_checkpoint(tiny_checkpoint, tmp_path)
    exports = checkpoint[0].parent / "exports"
    log = _worker_log(tmp_path, redis_server.url, checkpoint, "auto-none")
    assert f"backend torch (reference: no fidelity decision at {exports}/" in log, log[-3000:]
    assert "TOXFLEET_BACKEND=auto: using torch (reference: no fidelity decision" in log
    loaded = r"pool process \d+ loaded \S+ \(torch backend; a pass costs \d+ tokens beyond its own\)"
    assert re.search(loaded, log), log[-3000:]
    assert not exports.exists()


@pytest.mark.slow
def test_image_export_step_decides_next_to_the_checkpoint_for_default_workers(
        exported: WorkerSettings, tiny_checkpoint: tuple[Path, Path], tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Dockerfile.worker's export command (gate on), run verbatim without TOXFLEET_EXPORT_DIR, writes the
    decision next to the checkpoint; a default worker then runs the chosen backend, and on a CPU whose
    flags differ from the decision's it runs torch and says why."""
    from worker.gate.decision import Decision

    checkpoint = _private_checkpoint(tiny_checkpoint, tmp_path)
    # The export itself is the module fixture's (built and checked there); the command finds it current.
    source, sha = artifacts.export_location(exported)
    target = checkpoint[0].parent / "exports" / sha
    shutil.copytree(source, target)
    build = parse_dockerfile(ROOT / "Dockerfile.worker").stage("build")
    (step,) = [i.args for i in build.instructions if i.keyword == "RUN" and "worker.export" in i.args]
    (command,) = [c for c in shell_commands(step) if "worker.export" in c and "--no-gate" not in c]
    n = next(i for i, word in enumerate(command) if word == "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update(dict(w.partition("=")[::2] for w in command[:n]), TOXFLEET_CHECKPOINT=str(checkpoint[0]),
               TOXFLEET_HF_CONFIG=str(checkpoint[1]))
    # The stage runs the server packages from /opt/toxfleet/app, where it copied this tree's.
    assert any(i.keyword == "ENV" and "PYTHONPATH=/opt/toxfleet/app" in i.args for i in build.instructions)
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, *command[n + 1:]], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    decision = Decision.read(target)
    assert f"auto -> {decision.chosen} (written to {target}/" in done.stdout

    log = _worker_log(tmp_path, redis_server.url, checkpoint, "auto-decided")
    assert f"backend {decision.chosen} (fastest that passed the fidelity gate" in log, log[-3000:]
    assert f"({decision.chosen} backend;" in log

    other = another_cpu()
    dataclasses.replace(decision, kernel_signature=other).write(target)
    log = _worker_log(tmp_path, redis_server.url, checkpoint, "auto-other-cpu")
    assert f"backend torch (reference: decision was made on a CPU with [{other}]" in log, log[-3000:]
    assert "(torch backend;" in log


@pytest.mark.skipif(TorchCompiledBackend.unavailable() is not None,
                    reason=f"torch-compiled: {TorchCompiledBackend.unavailable()}")
def test_compiled_fp32_compiles_while_it_loads_and_is_within_the_fp32_budget(exported: WorkerSettings,
                                                                               reference) -> None:  # type: ignore[no-untyped-def]
    """`torch-compiled` compiles its graphs before it is ready, so no job waits for a compile whatever
    its batch size and lengths, and fused fp32 kernels change only summation order: it passes the
    FP32 budget against the reference, with no flip."""
    from torch._dynamo.utils import counters

    from worker.backends.loader import load_backend

    texts, ref_scores, labels = reference
    backend = load_backend("torch-compiled", exported)
    assert backend.precision == "fp32"
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= len(WARM_UP_BATCHES)
    row = measure(backend, texts, ref_scores, labels, exported)  # passes of 1 to 16 texts, many lengths
    assert counters["stats"]["unique_graphs"] == graphs
    assert row.passed and row.budget_max_abs == FP32_BUDGET.max_abs, row
    assert 0 < row.max_abs <= FP32_BUDGET.max_abs and row.flips == 0, row


@pytest.mark.skipif(TorchCompiledBackend.unavailable() is not None,
                    reason=f"torch-bf16-compiled: {TorchCompiledBackend.unavailable()}")
def test_compiled_bf16_compiles_while_it_loads_and_computes_what_eager_bf16_does(
        exported: WorkerSettings, reference, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """`torch-bf16-compiled` compiles its graphs before it is ready, so no job waits for a compile
    whatever its batch size and lengths, and it is as close to the reference as eager `torch-bf16`.
    The tiny checkpoint's random weights magnify bf16 rounding far past the reduced budget (both fail
    it here); whether a checkpoint may run it is the gate's call, on its trained weights. Checked on
    every CPU with a compiler: without bf16 units, emulated (`lift_speed_refusals`)."""
    from torch._dynamo.utils import counters

    from worker.backends.loader import load_backend

    lift_speed_refusals(monkeypatch)
    texts, ref_scores, labels = reference
    eager = measure(load_backend("torch-bf16", exported), texts, ref_scores, labels, exported)
    backend = load_backend("torch-bf16-compiled", exported)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= len(WARM_UP_BATCHES)
    row = measure(backend, texts, ref_scores, labels, exported)  # passes of 1 to 16 texts, many lengths
    assert counters["stats"]["unique_graphs"] == graphs
    assert 0 < row.mean_abs <= 1.25 * eager.mean_abs, (row, eager)
    assert row.min_spearman >= eager.min_spearman - 0.01, (row, eager)
    assert isinstance(backend, TorchBf16CompiledBackend)
    weights = {name: module.weight.dtype for name, module in _linears(backend._model._orig_mod)}
    assert {name for name, dtype in weights.items() if dtype == torch.float32} == _head(weights), weights
    assert len(_head(weights)) == 2 and set(weights.values()) == {torch.float32, torch.bfloat16}, weights


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _head(names: Iterable[str]) -> set[str]:
    """The Linear layers of `reduced.FP32_HEAD`: the pooler's and the classifier's."""
    return {name for name in names if "pooler" in name.split(".")[-2:] or name.startswith("classifier")}


def test_bf16_keeps_the_classification_head_in_fp32(exported: WorkerSettings,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `torch-bf16`'s autocast every Linear layer computes in bf16 but the pooler's and the
    classifier's, which stay fp32: their rounding would reach the scores undamped (`reduced.FP32_HEAD`).
    On every CPU: without bf16 units, emulated (`lift_speed_refusals`)."""
    from worker.backends.loader import load_backend

    lift_speed_refusals(monkeypatch)
    backend = load_backend("torch-bf16", exported)
    assert isinstance(backend, TorchBf16Backend)
    seen: dict[str, torch.dtype] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
            seen[name] = output.dtype  # None returned: a forward hook's non-None result replaces the output
        return hook

    for name, module in _linears(backend._model):
        module.register_forward_hook(record(name))
    backend.predict(backend.tokenize(["a short text", "and a longer one, with a comma"]))
    assert {name for name, dtype in seen.items() if dtype == torch.float32} == _head(seen), seen
    assert len(_head(seen)) == 2 and set(seen.values()) == {torch.float32, torch.bfloat16}, seen


def test_rowwise_int8_scores_a_text_the_same_whatever_shares_its_pass_or_is_refused(
        exported: WorkerSettings, reference, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """`torch-int8-rowwise` (per-row int8 `torch._int_mm`, some projections in bf16) on every CPU: with
    int8 dot products it computes differently from fp32 yet keeps its ranking, and a text scores as it
    does alone beside a long, different one (one scale per row); without them oneDNN's int8 matmul
    saturates, and the backend is refused before the model loads, naming what the CPU lacks."""
    from worker.backends.loader import load_backend
    from worker.backends.reduced import int8_dot_unavailable

    lift_speed_refusals(monkeypatch)  # its bf16 projections are emulated where the CPU lacks bf16 units
    if int8_dot_unavailable() is not None:
        with pytest.raises(RuntimeError, match="int8 dot products"):
            load_backend("torch-int8-rowwise", exported)
        return
    texts, ref_scores, labels = reference
    backend = load_backend("torch-int8-rowwise", exported)
    row = measure(backend, texts, ref_scores, labels, exported)
    # Saturated int8 arithmetic (oneDNN held to AVX2) gave a rank agreement of 0.09 here; per-row int8 0.94.
    assert row.mean_abs > 0 and row.min_spearman >= 0.8, row
    text, neighbour = backend.tokenize(["a short comment, thanks for sharing", "word " * 300 + "!!! ???"])
    alone, beside = backend.predict([text])[0], backend.predict([text, neighbour])[0]
    assert max(abs(a - b) for a, b in zip(alone, beside, strict=True)) <= 1e-4


@pytest.mark.parametrize(("name", "backend_class"), [("torch-compiled", TorchCompiledBackend),
                                                     ("torch-bf16-compiled", TorchBf16CompiledBackend)])
def test_compiled_backends_are_refused_without_a_compiler_before_the_model_loads(
        name: str, backend_class: type[TorchCompiledBackend], monkeypatch: pytest.MonkeyPatch,
        exported: WorkerSettings, tmp_path: Path) -> None:
    """Without a C++ compiler TorchInductor cannot build kernels: the backend refuses, saying so, before
    the loader spends a model load on it, and the gate records the reason as a failed row."""
    from worker.backends.loader import load_backend

    monkeypatch.delenv(COMPILER_ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler"):
        backend_class(object(), "m")
    # A checkpoint that does not exist: loading it would fail otherwise.
    absent = exported.model_copy(update={"checkpoint": tmp_path / "absent.ckpt"})
    with pytest.raises(RuntimeError, match=rf"{name} cannot run here: .*needs a C\+\+ compiler"):
        load_backend(name, absent)
    rows = run_gate(exported, backends=[name], texts=["a short text"])
    assert not rows[-1].passed and "needs a C++ compiler" in (rows[-1].error or ""), rows[-1]
