"""What the fault and recovery tests check on a load's outcome: a `Client.score()` run in the
background while a fault is injected, and its scores compared with Detoxify's own."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, is_dataclass
from typing import Any

from toxfleet.client import Client, JobNotFound, JobStatus, Result
from toxfleet.client.protocol import Submission

TOLERANCE = 1e-4
"""Largest difference from Detoxify's own probability that counts as equal (fp32 backends)."""

_PREDICT_BATCH = 32
"""Texts per `Detoxify.predict` call when computing the expected scores."""


RESULT_FIELDS = frozenset({"status", "results", "error", "model"})
"""What a job's final result is, for `TrackingClient.reread`: a request scored again may restamp its
`started_at`/`finished_at`, which is not a different result."""


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, Mapping):
        return [n for k in sorted(value) for n in _numbers(value[k])]
    if isinstance(value, list | tuple):
        return [n for v in value for n in _numbers(v)]
    return []


RESCORE_TOLERANCE = 1e-4
"""Largest probability difference between two readings that still counts as the same result: a request
scored again lands in a differently padded pass, and fp32 sums in another order (the fidelity gate's
fp32 budget, `worker.gate.fidelity.FP32_BUDGET`, holds a backend to the same bound)."""


def same_result(first: Any, later: Any) -> bool:
    """Whether two readings of one final result are the same: the same shape, text and statuses, and
    every number within `RESCORE_TOLERANCE`."""
    a, b = _numbers(first), _numbers(later)
    return (len(a) == len(b) and json.dumps(_strip(first), default=str) == json.dumps(_strip(later), default=str)
            and all(abs(x - y) <= RESCORE_TOLERANCE for x, y in zip(a, b, strict=True)))


def _strip(value: Any) -> Any:
    """`value` with every number replaced by 0 (what is left to compare once numbers are set aside)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return 0
    if isinstance(value, Mapping):
        return {k: _strip(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    return str(value)


def _plain(value: Any) -> Any:
    """A client result as plain data (dataclasses as dicts), for `same_result`."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


FINAL_WAIT_S = 120.0
"""How long `TrackingClient.reread` waits for a job it finds no longer final (scored again) to end."""


class TrackingClient(Client):
    """The official client, noting what a fault case measures through it: every job id the server
    accepted, per submission (a resubmit under the same Idempotency-Key is the same job), and each
    job's status when this client first read it final, with the time (monotonic)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: dict[str, list[str]] = {}
        self.texts: dict[str, list[str]] = {}
        self.final: dict[str, tuple[float, JobStatus]] = {}
        self.reopened: set[str] = set()
        """Jobs read final once and found not final on the second read (scored again)."""

    def _send(self, submission: Submission) -> str:
        job_id = super()._send(submission)
        self.accepted.setdefault(submission.key, []).append(job_id)
        self.texts[submission.key] = list(submission.body["texts"])
        return job_id

    def job_status(self, job_id: str, wait: float = 0.0) -> JobStatus:
        status = super().job_status(job_id, wait)
        if status.finished and job_id not in self.final:
            self.final[job_id] = (time.monotonic(), status)
        return status

    def original(self) -> dict[str, str]:
        """Each job id -> the id its submission was first accepted under."""
        return {j: ids[0] for ids in self.accepted.values() for j in ids}

    def reread(self, url: str) -> tuple[dict[str, str], set[str]]:
        """Every job read final, read again: (job id -> how its result now differs (`RESULT_FIELDS`), jobs
        now unknown)."""
        changed, vanished = {}, set()
        with Client(url) as plain:
            for job_id, (_, first) in self.final.items():
                try:
                    now = plain.job_status(job_id)
                    if not now.finished:
                        # Read final before, not final now: it is being scored again (its result was lost
                        # with Redis), or the API answered from the manifest it holds for a few seconds
                        # after a submit (api.services.manifests) and a long-poll finds the job gone.
                        # A finding of its own (`reopened`); what counts is what it ends with.
                        self.reopened.add(job_id)
                        deadline = time.monotonic() + FINAL_WAIT_S
                        while not now.finished and time.monotonic() < deadline:
                            now = plain.job_status(job_id, wait=10)
                except JobNotFound:
                    vanished.add(job_id)
                    self.reopened.discard(job_id)
                    continue
                differ = [f.name for f in fields(first) if f.name in RESULT_FIELDS
                          and not same_result(_plain(getattr(first, f.name)), _plain(getattr(now, f.name)))]
                if set(differ) & RESULT_FIELDS:
                    changed[job_id] = ", ".join(f"{n}: {getattr(first, n)!r:.80} -> {getattr(now, n)!r:.80}"
                                                for n in differ)
        return changed, vanished


class BackgroundScore(threading.Thread):
    """`Client(url, stall_after=...).score(texts, **options)` in a thread; `outcome()` joins it and
    returns the results, or raises what the client raised (not lost in the thread)."""

    def __init__(self, url: str, texts: Sequence[str], *, stall_after: float | None = 60.0,
                 **options: Any) -> None:
        super().__init__(name="background-score", daemon=True)
        self.url, self.texts, self.stall_after, self.options = url, list(texts), stall_after, options
        self.results: list[Result] | None = None
        self.error: BaseException | None = None
        self.client = TrackingClient(self.url, stall_after=self.stall_after)

    def run(self) -> None:
        try:
            with self.client as client:
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
