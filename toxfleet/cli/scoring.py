"""Where rows get their scores: a fleet over HTTP (`remote`) or the worker's scorer in this process
(`local`). Both take batches of rows and yield each batch with one `Scored` per row, in order."""

from __future__ import annotations

import argparse
import importlib
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from toxfleet.chunking import split
from toxfleet.cli import table
from toxfleet.client import Client, InvalidRequest, ToxfleetError
from toxfleet.thresholds import Thresholds

LOCAL_NEEDS = ("toxfleet: --local needs the worker tier, which runs from a toxfleet checkout (`make venv` installs its "
               "dependencies) or the worker image: {}")


@dataclass(frozen=True)
class Scored:
    """One row's outcome: scores and flags, or why it could not be scored."""

    scores: dict[str, float] | None
    flagged: bool | None = None
    error: str | None = None



def batched(rows: Iterable[table.Row], size: int, chars: int) -> Iterator[list[table.Row]]:
    """Consecutive batches of at most `size` rows and about `chars` characters of text, lazily."""
    return split(rows, lambda row: len(row.text or ""), chars, size)


def describe(error: Exception) -> str:
    if isinstance(error, InvalidRequest) and error.errors:
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in error.errors)
    return str(error)


def assemble(rows: Sequence[table.Row], outcomes: Iterator[Scored]) -> list[Scored]:
    """Per row: its own error if it had no text, else the next outcome (outcomes cover texted rows, in order)."""
    return [Scored(None, error=row.error) if row.text is None else next(outcomes) for row in rows]


def remote(client: Client, batches: Iterable[list[table.Row]], args: argparse.Namespace,
           thresholds: float | dict[str, float] | None) -> Iterator[tuple[list[table.Row], list[Scored]]]:
    """Rows with their outcomes, batch by batch in order, `args.in_flight` jobs at a time. A batch
    whose job fails is retried one row per job, so only the rows at fault carry the error."""
    rows_of: deque[list[table.Row]] = deque()

    def texts() -> Iterator[list[str]]:
        for rows in batches:
            rows_of.append(rows)
            yield [r.text for r in rows if r.text is not None]

    options: dict[str, Any] = {"long_text": args.long_text, "thresholds": thresholds, "in_flight": args.in_flight}
    for outcome in client.score_batches(texts(), **options):
        rows = rows_of.popleft()
        if outcome.error is None and outcome.results is not None:
            scored = (Scored(r.scores, r.flagged) for r in outcome.results)
        else:
            singles = client.score_batches(([t] for t in outcome.texts), **options)
            scored = (Scored(o.results[0].scores, o.results[0].flagged) if o.results
                      else Scored(None, error=describe(o.error or ToxfleetError("no result"))) for o in singles)
        yield rows, assemble(rows, scored)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, as Linux does; else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local(batches: Iterable[list[table.Row]], args: argparse.Namespace,
          thresholds: float | dict[str, float] | None) -> Iterator[tuple[list[table.Row], list[Scored]]]:
    """The same, scored in this process by the worker's scorer (needs the `worker` extra)."""
    try:
        # By name, at call time: the worker tier (torch, detoxify) is not part of this package; it is
        # importable from a checkout or the worker image, and only --local needs it.
        load_local_scorer = importlib.import_module("worker.local").load_local_scorer
    except ImportError as exc:
        raise SystemExit(LOCAL_NEEDS.format(exc)) from None
    try:
        scorer = load_local_scorer(args.threads or usable_cpus())
    except ImportError as exc:  # the worker package is there, its torch/detoxify are not
        raise SystemExit(LOCAL_NEEDS.format(exc)) from None
    flags = Thresholds().override(thresholds)

    def score(texts: list[str]) -> list[Scored]:
        results, _ = scorer.score(texts, args.long_text)
        return [Scored(r, flags.flags(r)["flagged"]) for r in results]

    for rows in batches:
        texts = [r.text for r in rows if r.text is not None]
        try:
            scored = score(texts)
        except Exception:  # find the rows at fault
            scored = []
            for text in texts:
                try:
                    scored += score([text])
                except Exception as exc:
                    scored.append(Scored(None, error=f"scoring failed: {exc!r}"))
        yield rows, assemble(rows, iter(scored))
