"""What the fault and recovery tests check on a load's outcome: a `Client.score()` run in the
background while a fault is injected, and its scores compared with Detoxify's own."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from toxfleet.client import Client, Result

TOLERANCE = 1e-4
"""Largest difference from Detoxify's own probability that counts as equal (fp32 backends)."""

_PREDICT_BATCH = 32
"""Texts per `Detoxify.predict` call when computing the expected scores."""


class BackgroundScore(threading.Thread):
    """`Client(url, stall_after=...).score(texts, **options)` in a thread; `outcome()` joins it and
    returns the results, or raises what the client raised (not lost in the thread)."""

    def __init__(self, url: str, texts: Sequence[str], *, stall_after: float | None = 60.0,
                 **options: Any) -> None:
        super().__init__(name="background-score", daemon=True)
        self.url, self.texts, self.stall_after, self.options = url, list(texts), stall_after, options
        self.results: list[Result] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.url, stall_after=self.stall_after) as client:
                self.results = client.score(self.texts, **self.options)
        except BaseException as exc:  # handed to outcome()
            self.error = exc

    def outcome(self, timeout: float) -> list[Result]:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"Client.score did not return within {timeout:g}s")
        if self.error is not None:
            raise self.error
        assert self.results is not None
        return self.results


def assert_detoxify_scores(reference: Any, texts: Sequence[str],
                           scores: Sequence[Mapping[str, float] | Result]) -> None:
    """Each row equals `reference.predict` (a Detoxify) on its text within TOLERANCE, in order, with
    the same labels. Rows are score dicts or client `Result`s."""
    assert len(scores) == len(texts), f"{len(scores)} results for {len(texts)} texts"
    for start in range(0, len(texts), _PREDICT_BATCH):
        batch = list(texts[start: start + _PREDICT_BATCH])
        expected = reference.predict(batch + [""])  # never one text: predict would return scalars
        for i, row in enumerate(scores[start: start + _PREDICT_BATCH]):
            got = row.scores if isinstance(row, Result) else row
            assert set(got) == set(expected), (start + i, sorted(got), sorted(expected))
            for label, value in got.items():
                assert abs(value - expected[label][i]) <= TOLERANCE, \
                    (start + i, label, value, expected[label][i], batch[i][:40])
