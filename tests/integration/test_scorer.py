"""The scorer against real Detoxify on the tiny synthetic checkpoint, and its pass planning."""

from __future__ import annotations

from typing import Any

import pytest

from toxfleet.corpus import CommentCorpus
from worker.scorer import plan_passes


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
