"""Pure logic of the shared contract: how jobs are split into task messages."""

from __future__ import annotations

from toxfleet import contract


def test_chunk_keeps_order_and_every_text() -> None:
    """Chunks concatenate back to the input, in order."""
    texts = [f"text {i} " * (i % 7) for i in range(100)]
    chunks = contract.chunk(texts)
    assert [t for c in chunks for t in c] == texts


def test_chunk_respects_both_budgets() -> None:
    """No chunk exceeds the text cap, nor the token budget unless it holds a single text."""
    texts = ["x" * (i * 97 % 3000) for i in range(200)]
    chunks = contract.chunk(texts, max_tokens=500, max_texts=8)
    assert len(chunks) > 1
    for c in chunks:
        assert 1 <= len(c) <= 8
        assert len(c) == 1 or sum(contract.estimate_tokens(t) for t in c) <= 500


def test_small_job_is_one_message() -> None:
    """A typical small job is one task message."""
    assert contract.chunk(["hello", "world"]) == [["hello", "world"]]


def test_estimate_is_capped_at_model_length() -> None:
    """A very long text costs what the model reads, not more."""
    assert contract.estimate_tokens("a" * 100_000) == contract.MODEL_MAX_TOKENS
    assert contract.estimate_tokens("") == 2


def test_chunk_task_ids_are_distinct_and_derived() -> None:
    """Chunk task ids derive from the job id, so the API needs no lookup table."""
    ids = {contract.chunk_task_id("ab" * 16, i) for i in range(50)}
    assert len(ids) == 50 and all(i.startswith("ab" * 16) for i in ids)


def test_windows_cover_the_text_with_the_overlap() -> None:
    """Windows start at 0, end at the text's end, are all full length and overlap by at least the overlap."""
    for length in (0, 1, 510, 511, 892, 893, 2000, 5001):
        starts = contract.window_starts(length, 510, 128)
        assert starts[0] == 0
        if length <= 510:
            assert starts == [0]
            continue
        assert starts[-1] == length - 510
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert all(0 < g <= 510 - 128 for g in gaps), (length, starts)


def test_windows_estimate_counts_every_window() -> None:
    """In windows mode a long text costs a full model length per window; a short one the same as truncate."""
    long_text = "a" * 8_000  # ~2000 tokens: 5 windows of 510 with 128 overlap
    assert contract.estimate_tokens(long_text, contract.WINDOWS) == 5 * contract.MODEL_MAX_TOKENS
    assert contract.estimate_tokens("short", contract.WINDOWS) == contract.estimate_tokens("short")
    assert len(contract.chunk([long_text] * 4, long_text=contract.WINDOWS)) == 4
