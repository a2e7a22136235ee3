"""The benchmark harness end to end, on real processes and the tiny checkpoint: the baseline service
answers like Detoxify itself, and `make bench-quick` measures all three systems and writes its report.

Select with `pytest -m bench`; deselect with `-m "not bench"`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.services import ROOT, http_json, start_baseline

pytestmark = pytest.mark.bench


def test_baseline_serves_detoxify_scores(tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any,
                                        tmp_path: Path) -> None:
    """The baseline under gunicorn returns exactly `Detoxify.predict([q])` for the same checkpoint."""
    from urllib.parse import quote

    ckpt, hf = tiny_checkpoint
    expected = tiny_detoxify.predict(["you are a fine person"])
    service, url = start_baseline(ckpt, hf, workers=2, log_dir=tmp_path)
    with service:
        assert len(service.procs) == 1
        status, body = http_json(f"{url}/toxicity?q={quote('you are a fine person')}")
        assert status == 200
        assert body.keys() == expected.keys()
        for label, value in expected.items():
            assert body[label] == pytest.approx(value, abs=1e-6)
        assert http_json(f"{url}/toxicity")[0] == 422
    assert service.procs == []
    assert "Booting worker" in (tmp_path / "baseline-gunicorn.log").read_text()


@pytest.mark.slow
def test_bench_quick_measures_everything(tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    """`python -m bench.run --quick` measures ceiling, baseline and toxfleet (both endpoints), closed and
    open loop, without errors in the closed loop, and renders the tables and plots."""
    out, md = tmp_path / "quick" / "results.json", tmp_path / "quick.md"
    models_dir = tiny_checkpoint[0].parent.parent
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--models-dir", str(models_dir),
                           "--out", str(out), "--report", str(md)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    model: dict[str, Any] = results["models"]["tiny"]
    assert model["tokens"]["count"] == model["profile"]["corpus"]
    assert model["ceiling"]["best"] and model["ceiling"]["reference"]["runs"]
    seen = {(p["system"], p["mode"], p["loop"]) for p in model["points"]}
    assert seen == {("baseline", "baseline", "closed"), ("baseline", "baseline", "open"),
                    ("toxfleet", "compat", "closed"), ("toxfleet", "jobs", "closed"), ("toxfleet", "jobs", "open")}
    for point in model["points"]:
        for w in point["windows"]:
            assert w["counts"]["ok"] > 0, point
            assert w["cpu"]["service"] > 0, point
            if point["loop"] == "closed":
                assert w["errors"] == 0, (point["system"], point["mode"], point.get("failures"))
                # CPU per process: every part of the service did work in every window.
                roles = {"server"} if point["system"] == "baseline" else {"api", "worker main", "pool", "redis"}
                assert set(w["cpu"]["roles"]) == roles and all(v > 0 for v in w["cpu"]["roles"].values()), w["cpu"]
        if point["system"] == "toxfleet":
            assert point["batches"]["batches"] > 0
    text = md.read_text()
    for heading in ("### Targets", "### Corpus: token lengths", "### Raw model ceiling", "### Closed loop",
                    "### Open loop"):
        assert heading in text
    assert "| service CPU ms per request | server ms | api ms | worker main ms | pool ms | redis ms |" in text
    for png in ("tiny-scaling.png", "tiny-latency-cdf.png", "tiny-tokens.png"):
        assert (out.parent / png).stat().st_size > 10_000
