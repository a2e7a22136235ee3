"""The scorer against real Detoxify on the tiny synthetic checkpoint, and its pass planning."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from fleet.corpus import CommentCorpus
from worker.backends.base import Backend
from worker.scorer import Scorer, measure_pass_overhead, plan_passes


def test_plan_passes_sorted_and_within_budget() -> None:
    """Passes hold texts of similar length, cover every index once, and stay under the padded budget."""
    lengths = [5, 300, 7, 512, 40, 41, 6, 200, 39, 8]
    passes = plan_passes(lengths, max_tokens=600, max_texts=3)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    for p in passes:
        assert len(p) <= 3
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 600
    flat = [lengths[i] for p in passes for i in p]
    assert flat == sorted(flat)


def test_plan_passes_single_long_text_gets_its_own_pass() -> None:
    """A text longer than the budget is still scored, alone."""
    assert plan_passes([900, 3], max_tokens=512, max_texts=8) == [[1], [0]]


@pytest.mark.parametrize(("max_tokens", "max_texts"), [(512, 1), (1024, 4), (4096, 64)])
def test_scores_equal_detoxify_whatever_the_batching(tiny_detoxify: Any, max_tokens: int, max_texts: int) -> None:
    """Padding and grouping never change a text's score: equal to Detoxify.predict on each text to 1e-4."""
    from worker.backends.torch import TorchBackend
    from worker.scorer import Scorer

    texts = CommentCorpus(11).texts(24) + ["", "short", "word " * 900]  # empty, tiny, and truncated
    scorer = Scorer(TorchBackend(tiny_detoxify, "tiny"), max_tokens, max_texts)
    got, stats = scorer.score(texts)
    assert len(got) == len(texts) and stats.texts == len(texts)
    assert stats.padded_tokens >= stats.tokens
    for text, row in zip(texts, got, strict=True):
        expected = tiny_detoxify.predict([text])  # one text: no padding at all
        assert set(row) == set(expected)
        for label, value in row.items():
            assert value == pytest.approx(expected[label], abs=1e-4), (label, text[:40])


def test_sorted_passes_pad_less_than_arrival_order(tiny_detoxify: Any) -> None:
    """On a realistic corpus, sorted passes compute far fewer padded tokens than arrival-order batches."""
    from worker.backends.torch import TorchBackend
    from worker.scorer import Scorer

    texts = CommentCorpus(3).texts(64)
    _, sorted_stats = Scorer(TorchBackend(tiny_detoxify, "tiny"), 2048, 8).score(texts)
    ids = TorchBackend(tiny_detoxify, "tiny").tokenize(texts)
    arrival_padded = sum(len(ids[i:i + 8]) * max(len(s) for s in ids[i:i + 8]) for i in range(0, 64, 8))
    assert sorted_stats.padded_tokens < 0.6 * arrival_padded


def test_plan_passes_does_not_pad_short_texts_to_long_ones() -> None:
    """Short and long texts go to separate passes when the padding saved outweighs a pass's overhead,
    although the cap would let them share one."""
    lengths = [20, 25, 30, 60, 61, 120]
    passes = plan_passes(lengths, max_tokens=1024, max_texts=16, overhead=16)
    padded = sum(len(p) * max(lengths[i] for i in p) for p in passes)
    assert padded <= 340 < 6 * 120
    assert [sorted(lengths[i] for i in p) for p in passes] == [[20, 25, 30], [60, 61], [120]]


def test_plan_passes_merges_when_the_overhead_dominates() -> None:
    """Texts of nearly equal length share a pass: another pass would cost more than it saves."""
    assert len(plan_passes([50, 51, 52, 53], max_tokens=1024, max_texts=16, overhead=16)) == 1


class _PacedBackend(Backend):
    """A backend whose pass takes `fixed + per_token x padded tokens` seconds (it sleeps): the fit's input."""

    name = "paced"
    labels = ["toxicity"]
    identity = "paced"

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[1] * min(512, len(t.split()) + 2) for t in texts]

    def predict(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        time.sleep(self.fixed + self.per_token * len(batch) * max(len(s) for s in batch))
        return [[0.5] for _ in batch]


@pytest.mark.parametrize(("fixed", "per_token", "expected"), [(0.004, 0.00004, 100), (0.002, 0.0001, 20)])
def test_measure_pass_overhead_fits_the_backends_own_costs(fixed: float, per_token: float, expected: int) -> None:
    """The fixed cost of a pass, in tokens, is read off the backend's timings: fixed / per token (sleep
    overshoots add to both probes alike, and the fastest of the repeats is kept)."""
    measured = measure_pass_overhead(_PacedBackend(fixed, per_token), max_tokens=1024, seconds=0.2)
    assert 0.6 * expected <= measured <= 1.6 * expected


def test_measure_pass_overhead_is_capped_by_a_pass() -> None:
    """A backend whose tokens cost nothing measurable plans as if a pass were all overhead (one pass per cap)."""
    assert measure_pass_overhead(_PacedBackend(0.002, 0.0), max_tokens=1024, seconds=0.05) in range(300, 1025)


def test_the_scorer_plans_with_its_own_overhead(tiny_detoxify: Any) -> None:
    """A scorer told that a pass costs more than the padding saves merges what one with the default splits."""
    from worker.backends.torch import TorchBackend

    backend = TorchBackend(tiny_detoxify, "tiny")
    texts = ["short"] * 3 + ["word " * 20, "word " * 40]  # 4, 62 and 122 tokens
    _, split = Scorer(backend, 1024, 16).score(texts)
    _, merged = Scorer(backend, 1024, 16, overhead=1024).score(texts)
    assert split.passes > 1 and merged.passes == 1


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_batch_pads_exactly_as_the_tokenizer(tiny_detoxify: Any, side: str) -> None:
    """Every backend pads with `pad_batch` instead of the tokenizer's slower `pad`: the same ids and
    mask, element for element, on either padding side."""
    import numpy as np

    from worker.backends.base import pad_batch

    tokenizer = tiny_detoxify.tokenizer
    ids = tokenizer(CommentCorpus(5).texts(6) + ["", "a much longer comment " * 20])["input_ids"]
    previous, tokenizer.padding_side = tokenizer.padding_side, side
    try:
        expected = tokenizer.pad({"input_ids": ids}, return_tensors="np")
        got_ids, got_mask = pad_batch(ids, int(tokenizer.pad_token_id), left=side == "left")
    finally:
        tokenizer.padding_side = previous
    assert len({len(s) for s in ids}) > 1  # the batch really needs padding
    np.testing.assert_array_equal(got_ids, expected["input_ids"])
    np.testing.assert_array_equal(got_mask, expected["attention_mask"])
