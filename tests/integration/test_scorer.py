"""The scorer against real Detoxify on the tiny synthetic checkpoint (its pass planning: unit/test_plan_passes.py)."""

from __future__ import annotations

from typing import Any

import pytest

from toxfleet.corpus import CommentCorpus


@pytest.mark.parametrize(("max_tokens", "max_texts"), [(512, 1), (1024, 4), (4096, 64)])
def test_scores_equal_detoxify_whatever_the_batching(tiny_detoxify: Any, max_tokens: int, max_texts: int) -> None:
    """Padding and grouping never change a text's score: equal to Detoxify.predict on each text to 1e-4."""
    from worker.backend import TorchBackend
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
    from worker.backend import TorchBackend
    from worker.scorer import Scorer

    texts = CommentCorpus(3).texts(64)
    _, sorted_stats = Scorer(TorchBackend(tiny_detoxify, "tiny"), 2048, 8).score(texts)
    ids = TorchBackend(tiny_detoxify, "tiny").tokenize(texts)
    arrival_padded = sum(len(ids[i:i + 8]) * max(len(s) for s in ids[i:i + 8]) for i in range(0, 64, 8))
    assert sorted_stats.padded_tokens < 0.6 * arrival_padded
