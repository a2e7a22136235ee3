"""A seeded, synthetic comment corpus.

Real comment data cannot be downloaded here, so tests, synthetic tokenizers and benchmarks share this
generator. What it imitates is the *shape* of forum comments, because that is what drives cost:
word counts are log-normal (median about 36 words, mean about 65, a long tail that the model cuts at
512 tokens) and words follow a Zipf law over a pseudo-English vocabulary, so a tokenizer trained on it
splits rare words into several pieces the way a real one does. The words mean nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

DEFAULT_SEED = 20261130
"""Seed used when none is given, so every run of a benchmark sees the same texts."""

MEDIAN_WORDS = 36
"""Median words per comment (log-normal location)."""

MEAN_WORDS = 65
"""Mean words per comment; with the median this fixes the log-normal spread."""

MAX_WORDS = 600
"""Longest comment generated; past 512 tokens the model truncates anyway."""

VOCABULARY_SIZE = 40_000
"""Distinct pseudo-words; the tokenizer vocabulary is smaller, so rare words split."""

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "y", "z", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st", "nd", "rt"]
_PUNCTUATION = [".", ",", "!", "?", "..."]


def _word(rng: random.Random) -> str:
    syllables = 1 + min(4, int(rng.expovariate(0.9)))
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables))


def vocabulary(seed: int = DEFAULT_SEED, size: int = VOCABULARY_SIZE) -> list[str]:
    """Distinct pseudo-words, most frequent first (shorter words are made likelier to rank high)."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < size:
        words.setdefault(_word(rng), None)
    return sorted(words, key=lambda w: (len(w) + rng.random() * 6))


class CommentCorpus:
    """An endless, reproducible stream of comment-like texts."""

    def __init__(self, seed: int = DEFAULT_SEED, duplicate_rate: float = 0.0) -> None:
        if not 0.0 <= duplicate_rate < 1.0:
            raise ValueError("duplicate_rate must be in [0, 1)")
        self._rng = random.Random(seed)
        self._words = vocabulary(seed)
        # Zipf weights, as cumulative sums for fast sampling.
        weights = [1.0 / (rank + 1) ** 1.07 for rank in range(len(self._words))]
        total = 0.0
        self._cumulative = []
        for w in weights:
            total += w
            self._cumulative.append(total)
        self._sigma = math.sqrt(2 * math.log(MEAN_WORDS / MEDIAN_WORDS))
        self._duplicate_rate = duplicate_rate
        self._seen: list[str] = []

    def _length(self) -> int:
        n = int(round(self._rng.lognormvariate(math.log(MEDIAN_WORDS), self._sigma)))
        return max(1, min(MAX_WORDS, n))

    def text(self) -> str:
        """One comment; with `duplicate_rate`, some repeat an earlier one exactly (spam, copy-paste)."""
        if self._seen and self._rng.random() < self._duplicate_rate:
            return self._rng.choice(self._seen)
        picks = self._rng.choices(self._words, cum_weights=self._cumulative, k=self._length())
        out: list[str] = []
        sentence_start = True
        for word in picks:
            out.append(word.capitalize() if sentence_start else word)
            sentence_start = False
            if self._rng.random() < 0.08:
                out[-1] += self._rng.choice(_PUNCTUATION)
                sentence_start = out[-1][-1] in ".!?"
        text = " ".join(out)
        if self._duplicate_rate:
            self._seen.append(text)
        return text

    def texts(self, n: int) -> list[str]:
        """The next `n` comments."""
        return [self.text() for _ in range(n)]

    def __iter__(self) -> Iterator[str]:
        while True:
            yield self.text()
