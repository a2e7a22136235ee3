"""The `toxfleet` command: bulk-score a JSONL or CSV file against a running fleet (or in-process).

    toxfleet score comments.jsonl -o scored.jsonl --field body
    toxfleet score comments.csv --url https://toxfleet.internal --api-key $KEY --long-text windows
    toxfleet score small.csv --local          # no fleet: the model in this process (worker extra)

Every input row is written to the output, in input order, with each label's probability appended
(and `flagged`); a row that cannot be scored is written with an `error` field instead and counted
in the summary, never dropped. Many jobs are kept in flight; a progress line on stderr shows rate
and ETA. Re-running the same command resumes: rows already in the output are skipped.

Exit status: 0 all rows scored; 1 error; 2 usage; 3 finished but some rows failed; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from toxfleet.cli import table
from toxfleet.cli.progress import Progress
from toxfleet.cli.scoring import Scored, batched, local, remote
from toxfleet.client import DEFAULT_IN_FLIGHT, DEFAULT_JOB_CHARS, DEFAULT_STALL_AFTER, Client, ToxfleetError
from toxfleet.contract import LABELS, LONG_TEXT_MODES, TRUNCATE
from toxfleet.thresholds import Thresholds

DEFAULT_URL = "http://127.0.0.1:8000"
"""API the CLI talks to unless `--url` or `TOXFLEET_URL` says otherwise."""

DEFAULT_JOB_ROWS = 128
"""Rows per job in bulk scoring: large enough that HTTP costs little, small enough to resume finely."""

DEFAULT_LOCAL_ROWS = 64
"""Rows per scorer call in `--local` mode."""

EXIT_FAILED_ROWS = 3
EXIT_INTERRUPTED = 130


class _Interrupts:
    """SIGINT/SIGTERM raise KeyboardInterrupt, except while rows are being written: then the
    interrupt waits for the write to finish, so the output never ends in a torn row."""

    def __init__(self) -> None:
        self._protecting = False
        self._deferred = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._protecting:
            self._deferred = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def protect(self) -> Iterator[None]:
        self._protecting = True
        try:
            yield
        finally:
            self._protecting = False
            if self._deferred:
                raise KeyboardInterrupt


def _check_reachable(url: str) -> None:
    """Fail at once, not after the retry budget, when the URL is wrong or nothing listens there."""
    try:
        httpx.get(url.rstrip("/") + "/healthz", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise SystemExit(f"toxfleet: cannot reach the toxfleet API at {url} ({exc}); set --url or TOXFLEET_URL") \
            from None


def _output_row(row: table.Row, scored: Scored, prefix: str) -> dict[str, Any]:
    out = dict(row.fields)
    if scored.error is not None or scored.scores is None:
        out[table.ERROR_FIELD] = scored.error or "not scored"
        return out
    out.update({prefix + label: value for label, value in scored.scores.items()})
    if scored.flagged is not None:
        out[table.FLAGGED_FIELD] = scored.flagged
    return out


def _thresholds(args: argparse.Namespace) -> float | dict[str, float] | None:
    if args.thresholds is None:
        threshold: float | None = args.threshold
        return threshold
    text = args.thresholds.strip()
    if text.startswith("{"):
        per_label: dict[str, float] = {str(k): float(v) for k, v in json.loads(text).items()}
    else:
        per_label = {k.strip(): float(v) for k, v in (p.split("=", 1) for p in text.split(",") if p.strip())}
    if args.threshold is not None:
        # One number for every label plus per-label exceptions: spell out the exceptions' complement.
        return {**dict.fromkeys(LABELS, args.threshold), **per_label}
    return per_label


def _default_output(path: str, fmt: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.scored.{fmt}"))


def score_command(args: argparse.Namespace) -> int:
    fmt_in = args.input_format or table.guess_format(args.input)
    out_path = args.output or _default_output(args.input, fmt_in)
    fmt_out = args.output_format or (table.guess_format(out_path) if out_path != "-" else fmt_in)
    if not os.path.isfile(args.input):
        raise SystemExit(f"toxfleet: no such file: {args.input}")
    try:
        thresholds = _thresholds(args)
        Thresholds().override(thresholds)  # fail on a bad threshold before any work
    except ValueError as exc:
        raise SystemExit(f"toxfleet: {exc}") from None

    total = table.count_rows(args.input, fmt_in, args.field)
    if out_path != "-" and args.overwrite and os.path.exists(out_path):
        os.truncate(out_path, 0)
    resume = table.inspect_output(out_path, fmt_out) if out_path != "-" else table.Resume(0, None, None)
    if resume.rows > total:
        raise SystemExit(f"toxfleet: {out_path} has {resume.rows} rows but {args.input} only {total}: "
                         f"not this input's output? (--overwrite starts over)")

    rows = table.read_rows(args.input, fmt_in, args.field)
    last: table.Row | None = None
    for _ in range(resume.rows):
        last = next(rows)
    if last is not None and last.text is not None and resume.last is not None \
            and str(resume.last.get(args.field)) != last.text:
        raise SystemExit(f"toxfleet: the last row of {out_path} is not row {resume.rows} of {args.input}: "
                         f"not this input's output? (--overwrite starts over)")

    interrupts = _Interrupts()
    interrupts.install()
    progress = Progress(total, resume.rows, enabled=not args.no_progress)
    if resume.rows:
        progress.close(f"resuming: {resume.rows} of {total} rows already in {out_path}")
    out = table.open_output(out_path)
    writer = table.Writer(out, fmt_out, resume.header)
    pending: list[dict[str, Any]] = []  # CSV rows held until the first scored row names the label columns
    client: Client | None = None
    try:
        if args.local:
            batches = batched(rows, args.job_size or DEFAULT_LOCAL_ROWS, DEFAULT_JOB_CHARS)
            outcomes = local(batches, args, thresholds)
        else:
            client = Client(args.url, args.api_key, stall_after=args.stall_after or None)
            _check_reachable(args.url)
            batches = batched(rows, args.job_size or DEFAULT_JOB_ROWS, DEFAULT_JOB_CHARS)
            outcomes = remote(client, batches, args, thresholds)
        for batch_rows, scored in outcomes:
            out_rows = [_output_row(r, s, args.prefix) for r, s in zip(batch_rows, scored, strict=True)]
            header = None
            if fmt_out == "csv" and writer.header is None:
                first = next((s for s in scored if s.scores is not None), None)
                if first is None:
                    pending += out_rows
                    out_rows = []
                else:
                    header = _csv_header(batch_rows[0].fields, first, args.prefix)
                    out_rows, pending = pending + out_rows, []
            with interrupts.protect():
                writer.write(out_rows, header)
            progress.update(len(batch_rows), sum(s.error is not None for s in scored))
        if pending:
            with interrupts.protect():
                writer.write(pending, [*pending[0], table.ERROR_FIELD])
    except KeyboardInterrupt:
        progress.close(f"interrupted: {progress.initial + progress.done} of {total} rows in {out_path}; "
                       f"run the same command again to resume")
        return EXIT_INTERRUPTED
    except ToxfleetError as exc:
        progress.close(f"toxfleet: {exc} ({progress.initial + progress.done} of {total} rows in {out_path}; "
                       f"re-run to resume)")
        return 1
    finally:
        if client is not None:
            client.close()
        if out is not sys.stdout:
            out.close()
    summary = (f"done: {progress.done} rows scored in this run at {progress.rate:.1f} rows/s, "
               f"{total} in {out_path}")
    if progress.failed:
        progress.close(f"{summary}; {progress.failed} rows failed (see their '{table.ERROR_FIELD}' field)")
        return EXIT_FAILED_ROWS
    progress.close(summary)
    return 0


def _csv_header(fields: dict[str, Any], first: Scored, prefix: str) -> list[str]:
    labels = [prefix + label for label in (first.scores or {})]
    extra = [table.FLAGGED_FIELD] if first.flagged is not None else []
    return [*(f for f in fields if f not in labels), *labels, *extra, table.ERROR_FIELD]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toxfleet", description="toxfleet: toxicity scoring at scale.")
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("score", help="bulk-score a JSONL or CSV file",
                            description="Score every row of a JSONL or CSV file; append each label's probability "
                                        "and `flagged`. Resumes when re-run on the same output.")
    s.add_argument("input", help="input file: JSONL (one object a line) or CSV with a header")
    s.add_argument("-o", "--output", help="output file (.jsonl or .csv; '-' for stdout, not resumable); "
                                          "default: INPUT.scored.<format>")
    s.add_argument("--field", "--column", default="text", help="field/column holding the text (default: text)")
    s.add_argument("--input-format", choices=table.FORMATS, help="default: from the input's extension")
    s.add_argument("--output-format", choices=table.FORMATS, help="default: from the output's extension")
    s.add_argument("--url", default=os.environ.get("TOXFLEET_URL", DEFAULT_URL),
                   help="toxfleet API (default: $TOXFLEET_URL or %(default)s)")
    s.add_argument("--api-key", default=os.environ.get("TOXFLEET_API_KEY"), help="default: $TOXFLEET_API_KEY")
    s.add_argument("--long-text", choices=LONG_TEXT_MODES, default=TRUNCATE,
                   help="texts over 512 tokens: 'truncate' (Detoxify's behaviour) or 'windows' "
                        "(every part read; costs a forward pass per window)")
    s.add_argument("--threshold", type=float, help="flag threshold for every label (default: the server's, 0.5)")
    s.add_argument("--thresholds", help="per-label thresholds: 'threat=0.3,insult=0.8' or JSON")
    s.add_argument("--prefix", default="", help="prefix for the label columns (e.g. 'tox_')")
    s.add_argument("--job-size", type=int, help=f"rows per job (default {DEFAULT_JOB_ROWS}; "
                                                f"--local: {DEFAULT_LOCAL_ROWS} per scorer call)")
    s.add_argument("--in-flight", type=int, default=DEFAULT_IN_FLIGHT,
                   help="jobs submitted at once (default %(default)s)")
    s.add_argument("--stall-after", type=float, default=DEFAULT_STALL_AFTER,
                   help="seconds a job may make no progress while the fleet is ready before it is submitted "
                        "again (a job lost with the broker; one answering 404 is resubmitted at once); "
                        "0: never (default %(default)s)")
    s.add_argument("--local", action="store_true",
                   help="score in this process, no fleet (needs the worker extra and TOXFLEET_CHECKPOINT/"
                        "TOXFLEET_HF_CONFIG or a downloadable TOXFLEET_MODEL); for small files")
    s.add_argument("--threads", type=int, help="--local: torch threads (default: the CPUs available)")
    s.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    s.add_argument("--no-progress", action="store_true", help="no progress line (the summary still prints)")
    s.set_defaults(func=score_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "job_size", None) is not None and args.job_size < 1:
        raise SystemExit("toxfleet: --job-size must be at least 1")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
