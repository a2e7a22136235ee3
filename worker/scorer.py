"""Turn a batch of texts into forward passes that waste little compute, and scores back in order.

Detoxify pads every text to the longest one in a forward pass, so a batch taken in arrival order
spends most of its compute on padding (it can be slower than no batching at all). The
scorer tokenizes once, sorts by length, and cuts the sorted run into the passes that cost least in
all, each within a padded-size cap, then puts the scores back in input order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from toxfleet.contract import LONG_TEXT_MODES, TRUNCATE, WINDOWS
from worker.backends.base import Backend


@dataclass(frozen=True)
class ScoreStats:
    """What one `Scorer.score` call cost, for logs and metrics."""

    texts: int
    passes: int
    tokens: int
    padded_tokens: int


PASS_OVERHEAD_TOKENS = 16
"""What one forward pass costs beyond its padded tokens, in tokens, for ALBERT-base fp32 on one
thread (how it was derived: docs/benchmarks.md). It decides when splitting a pass to save
padding pays. Workers time their own backend instead (`measure_pass_overhead`): on a small or fast
model the fixed part of a pass is worth far more tokens."""

PROBE_TOKENS = (32, 256)
"""Lengths of the two one-text passes `measure_pass_overhead` times: the line through their costs
gives the fixed part of a pass and the cost of a token."""

PROBE_SECONDS = 1.0
"""Time `measure_pass_overhead` may spend after its warm-up pass (at least one timing of each length)."""


def plan_passes(lengths: Sequence[int], max_tokens: int, max_texts: int,
                overhead: int = PASS_OVERHEAD_TOKENS) -> list[list[int]]:
    """Group text indices into passes of consecutive lengths (sorted), minimising padded tokens plus
    `overhead` per pass, each pass within `max_texts` texts and `max_tokens` padded tokens (a single
    text longer than that still gets a pass). Filling passes greedily up to the cap would put a
    20-token text beside a 120-token one just because the cap allows it."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    # cost[j]: least cost of the first j sorted texts; cut[j]: where their last pass starts.
    cost = [0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]  # sorted: the last text of a pass is its longest
        cost[j], cut[j] = cost[j - 1] + overhead + longest, j - 1  # a pass of its own always fits
        for i in range(j - 2, max(-1, j - 1 - max_texts), -1):
            size = j - i
            if size * longest > max_tokens:
                break
            candidate = cost[i] + overhead + size * longest
            if candidate < cost[j]:
                cost[j], cut[j] = candidate, i
    passes: list[list[int]] = []
    j = n
    while j > 0:
        passes.append(order[cut[j]:j])
        j = cut[j]
    return passes[::-1]


def measure_pass_overhead(backend: Backend, max_tokens: int, seconds: float = PROBE_SECONDS) -> int:
    """What one forward pass of `backend` costs beyond its padded tokens, in tokens (at least 1, at most
    `max_tokens`): the fastest of repeated one-text passes of each `PROBE_TOKENS` length, fitted to
    `overhead + tokens`. Measured, because the constant differs by two orders of magnitude between
    models: ~16 tokens on ALBERT-base in fp32, where compute dominates, far more on a small model or a
    fast backend, where the framework's fixed cost per pass does (and planning with 16 there splits
    batches into passes that cost more than the padding they save)."""
    # The special tokens alone (an empty text's): ids every vocabulary has, where a word's id may be
    # one a model cannot embed (and a pass costs the same whatever its ids).
    special = backend.tokenize([""])[0] or [0]
    probes = [[special[0]] * (n - 1) + [special[-1]] for n in PROBE_TOKENS]
    best = [float("inf")] * len(probes)
    for probe in probes:  # warm-up: the first pass of a shape allocates and picks kernels
        backend.predict([probe])
    deadline = time.perf_counter() + seconds
    while True:
        for i, probe in enumerate(probes):
            started = time.perf_counter()
            backend.predict([probe])
            best[i] = min(best[i], time.perf_counter() - started)
        if time.perf_counter() >= deadline:
            break
    (short, long), (t_short, t_long) = PROBE_TOKENS, best
    per_token = (t_long - t_short) / (long - short)
    if per_token <= 0:  # timing noise swamped the tokens' cost: a pass is all overhead
        return max_tokens
    return max(1, min(max_tokens, round(t_short / per_token - short)))


def planned(backend: Backend, max_tokens: int, max_texts: int, overhead: int | None) -> Scorer:
    """A Scorer that plans passes with `overhead`, or, when it is None, with the backend's own cost of a
    pass, timed now (`measure_pass_overhead`): what a worker process scores with."""
    if overhead is None:
        overhead = measure_pass_overhead(backend, max_tokens)
    return Scorer(backend, max_tokens, max_texts, overhead)


class Scorer:
    """Scores texts with a backend, in length-sorted, padding-capped forward passes."""

    def __init__(self, backend: Backend, max_tokens: int, max_texts: int,
                 overhead: int = PASS_OVERHEAD_TOKENS) -> None:
        self.backend = backend
        self.max_tokens = max_tokens
        self.max_texts = max_texts
        self.overhead = overhead
        """What a pass costs beyond its padded tokens, in tokens (`plan_passes`)."""

    @property
    def labels(self) -> list[str]:
        return self.backend.labels

    def score(self, texts: Sequence[str], long_text: str | Sequence[str] = TRUNCATE,
              on_pass: Callable[[list[int], list[list[float]]], None] | None = None
              ) -> tuple[list[dict[str, float]], ScoreStats]:
        """One `{label: probability}` dict per text, in input order. `long_text` (one mode, or one per
        text): "truncate" reads a text's first `MODEL_MAX_TOKENS` tokens, as Detoxify does; "windows"
        reads every overlapping window of a longer text and gives each label its max over them.
        `on_pass(texts, probabilities)` hears each pass as it is scored (the input index of each of its
        sequences, their rows): the fidelity gate's progress, and its early verdicts (it may raise)."""
        if not texts:
            return [], ScoreStats(0, 0, 0, 0)
        modes = [long_text] * len(texts) if isinstance(long_text, str) else list(long_text)
        if len(modes) != len(texts) or not set(modes) <= set(LONG_TEXT_MODES):
            raise ValueError(f"long_text must be one of {LONG_TEXT_MODES}, one per text")
        # Every sequence (a truncated text, or one window of a long one) goes through the same
        # sorted, padding-capped passes; `owner` maps a sequence back to its text.
        ids: list[list[int]] = []
        owner: list[int] = []
        truncated = [i for i, m in enumerate(modes) if m == TRUNCATE]
        windowed = [i for i, m in enumerate(modes) if m == WINDOWS]
        if truncated:
            ids += self.backend.tokenize([texts[i] for i in truncated])
            owner += truncated
        if windowed:
            for i, windows in zip(windowed, self.backend.tokenize_windows([texts[i] for i in windowed]), strict=True):
                ids += windows
                owner += [i] * len(windows)
        lengths = [len(seq) for seq in ids]
        labels = self.backend.labels
        results: list[dict[str, float] | None] = [None] * len(texts)
        passes = plan_passes(lengths, self.max_tokens, self.max_texts, self.overhead)
        padded = 0
        for group in passes:
            probs = self.backend.predict([ids[j] for j in group])
            if len(probs) != len(group):
                raise RuntimeError(f"backend returned {len(probs)} rows for {len(group)} texts")
            if on_pass is not None:
                on_pass([owner[j] for j in group], probs)
            padded += len(group) * max(lengths[j] for j in group)
            for j, row in zip(group, probs, strict=True):
                scores = dict(zip(labels, row, strict=True))
                earlier = results[owner[j]]
                results[owner[j]] = scores if earlier is None else {k: max(v, earlier[k]) for k, v in scores.items()}
        stats = ScoreStats(len(texts), len(passes), sum(lengths), padded)
        done = [r for r in results if r is not None]
        if len(done) != len(texts):
            raise RuntimeError(f"scored {len(done)} of {len(texts)} texts")
        return done, stats
