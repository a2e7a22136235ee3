"""The scorer's pass planning: which texts share a forward pass (a pure function of the token counts)."""

from __future__ import annotations

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
