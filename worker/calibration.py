"""Calibration texts for int8 recipes that fix anything from data (SmoothQuant's per-channel maxima).

They are comment-like texts with injected phrases, drawn like the gate corpus's (`worker.gate.probes`)
but from their own seed, so a recipe is never calibrated on the texts the fidelity gate judges it on
(`worker.gate.fidelity.GATE_SEED`) nor on the benchmark's (`tools.int8_bench`: seeds 7 and 11).
"""

from __future__ import annotations

import random

from fleet.corpus import CommentCorpus
from worker.gate.probes import labelled_text

CALIBRATION_SEED = 20261201
"""Seed of the calibration corpus: different from every corpus that judges or times a recipe."""

CALIBRATION_TEXTS = 128
"""Texts a calibration scores by default (a few seconds of fp32 on MiniLM, ~40 s on ALBERT-base)."""


def calibration_texts(n: int = CALIBRATION_TEXTS, seed: int = CALIBRATION_SEED) -> list[str]:
    """`n` comment-like texts, 70 % carrying a phrase, drawn from `seed` (not a gate or bench seed)."""
    rng = random.Random(seed)
    corpus = CommentCorpus(seed)
    return [labelled_text(rng, corpus, 0.7, None)[0] for _ in range(n)]
