"""long_text="windows" on the tiny checkpoint, against Detoxify itself: a long text's tail, which
truncation never reads, changes the score; each label is the max over the windows' own scores."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.corpus import CommentCorpus
from toxfleet import contract


@pytest.fixture(scope="module")
def scorer(tiny_detoxify: Any) -> Any:
    from worker.backends.torch import TorchBackend
    from worker.scorer import Scorer

    return Scorer(TorchBackend(tiny_detoxify, "tiny"), 1024, 16)


def single_token_words(tokenizer: Any, n: int) -> list[str]:
    """Words the tokenizer reads as exactly one token, so a window of tokens is a window of words and
    its text is well defined."""
    words: list[str] = []
    for word in dict.fromkeys(" ".join(CommentCorpus(5).texts(100)).lower().replace(".", " ").split()):
        if word.isalpha() and len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
            if len(words) == n:
                break
    assert len(words) == n
    return words


@pytest.fixture(scope="module")
def long_text(tiny_detoxify: Any) -> tuple[str, list[str]]:
    """~1,400 single-token words: a bland head and, past token 900, the tail that scores highest on
    toxicity of a few candidates (on random weights "toxic-looking" means: scores high on its own)."""
    words = single_token_words(tiny_detoxify.tokenizer, 60)
    head = [words[i % 20] for i in range(900)]
    candidates = [[words[20 + (i * k) % 40] for i in range(500)] for k in (1, 3, 7, 11)]
    tail = max(candidates, key=lambda ws: tiny_detoxify.predict(" ".join(ws[:400]))["toxicity"])
    all_words = head + tail
    return " ".join(all_words), all_words


def test_short_texts_score_the_same_in_both_modes(scorer: Any) -> None:
    """A text that fits the model has one window, so windows mode equals truncate mode exactly."""
    texts = CommentCorpus(8).texts(12) + ["", "x"]
    assert scorer.score(texts, "windows")[0] == scorer.score(texts, "truncate")[0]


def test_first_window_is_the_truncated_text(scorer: Any, long_text: tuple[str, list[str]]) -> None:
    """The first window's ids are exactly what truncation (and so Detoxify) reads; all have model length."""
    text, _ = long_text
    windows = scorer.backend.tokenize_windows([text])[0]
    assert windows[0] == scorer.backend.tokenize([text])[0]
    assert len(windows) > 2 and {len(w) for w in windows} == {contract.MODEL_MAX_TOKENS}


def test_windows_read_the_tail_truncation_misses(scorer: Any, tiny_detoxify: Any,
                                                long_text: tuple[str, list[str]]) -> None:
    """On a long text with a high-scoring tail, windows score it higher than truncation (which equals
    Detoxify.predict on the whole text), and each label equals the max over Detoxify.predict of each
    window's text, to 1e-4."""
    text, words = long_text
    truncated = scorer.score([text], "truncate")[0][0]
    windowed = scorer.score([text], "windows")[0][0]
    reference = tiny_detoxify.predict(text)
    for label, value in truncated.items():
        assert value == pytest.approx(reference[label], abs=1e-4)
    assert windowed["toxicity"] > truncated["toxicity"] + 0.05, (truncated, windowed)

    size = contract.MODEL_MAX_TOKENS - 2  # content tokens per window (ALBERT adds [CLS] and [SEP])
    window_texts = [" ".join(words[s: s + size]) for s in contract.window_starts(len(words), size)]
    tokenizer = tiny_detoxify.tokenizer
    ids = scorer.backend.tokenize_windows([text])[0]
    assert [tokenizer(t)["input_ids"] for t in window_texts] == ids  # the window texts are the windows
    per_window = [tiny_detoxify.predict(t) for t in window_texts]
    for label, value in windowed.items():
        assert value == pytest.approx(max(p[label] for p in per_window), abs=1e-4), label


def test_mixed_modes_in_one_call(scorer: Any, long_text: tuple[str, list[str]]) -> None:
    """One call may mix modes per text (a worker batch does): each text gets its own mode's score."""
    text, _ = long_text
    short = "a short comment"
    mixed = scorer.score([text, short, text], ["windows", "truncate", "truncate"])[0]
    assert mixed[0] == pytest.approx(scorer.score([text], "windows")[0][0], abs=1e-6)
    assert mixed[2] == pytest.approx(scorer.score([text], "truncate")[0][0], abs=1e-6)
    with pytest.raises(ValueError):
        scorer.score([short], "summarise")
