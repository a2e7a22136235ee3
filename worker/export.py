"""Ahead-of-time ONNX export and int8 quantization of a Detoxify checkpoint, then the fidelity gate.

Workers never export: they load what this command built (`worker.onnx_export`), and refuse an export
that is missing, stale or corrupt with one line naming this command. It rebuilds what is missing or
stale, runs the fidelity gate on this CPU (`worker.gate`) and writes the decision that
`TOXFLEET_BACKEND=auto` reads:

    python -m worker.export                # reads TOXFLEET_CHECKPOINT / TOXFLEET_HF_CONFIG / TOXFLEET_MODEL
    python -m worker.export --check        # verify only; exit 1 with the reason if a worker would refuse it
    python -m worker.export --no-gate      # artifacts and the reference's scores (no gate: minutes saved)
    python -m worker.export --no-gate --no-reference   # artifacts only
    python -m worker.export --backends onnx,onnx-int8   # gate only these (auto chooses among them)
    python -m worker.export --prepare      # what the configured backend needs, only if missing (`make run`)

Besides the artifacts, it keeps the torch reference's scores of the gate corpus in the export directory
(`worker.gate.reference`), once per checkpoint: they do not depend on the CPU, so the gate on any CPU
(here, or a worker's at run time) reads them instead of scoring the corpus with the reference again.

`--prepare` is what `scripts/run.sh` runs before the workers start. For `auto`: nothing (the workers
serve with the reference at once, and their runtime gate exports and gates in the background,
`worker.gate.background`), unless TOXFLEET_RUNTIME_GATE=0 and no valid decision exists for this
checkpoint's sha256 on this CPU and these versions: then the export, then the gate, which writes the
decision. For a forced backend that loads an export (`onnx`, `onnx-int8`): the export (no gate). For
the torch backends: nothing.

This module is an entry point on top of `worker.onnx_export` and `worker.gate`; nothing imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from worker.gate import cli as gate_cli
from worker.gate.fidelity import DEFAULT_TEXTS, gate_texts, reference_scores
from worker.gate.selection import valid_decision
from worker.onnx_export.artifacts import ExportError, export_location, verify_export
from worker.onnx_export.build import ensure_export
from worker.settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="verify the export only; exit 1 if a worker would refuse it")
    parser.add_argument("--force", action="store_true", help="rebuild even if the export is current")
    parser.add_argument("--no-gate", action="store_true", help="skip the fidelity gate and the auto decision")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="with --no-gate: do not score the gate corpus with the reference either (the gate "
                             "then does it, on whichever CPU runs it first)")
    parser.add_argument("--texts", type=int, default=None, help="gate corpus size (default: worker.gate's)")
    parser.add_argument("--backends", type=gate_cli.backend_list, default=None,
                        help="comma-separated backends to gate (default: worker.gate's candidates; the "
                             "compiled ones cost most of the gate's time, tens of seconds each to trace)")
    parser.add_argument("--prepare", action="store_true",
                        help="prepare what TOXFLEET_BACKEND needs, only if missing (export; gate for auto)")
    parser.add_argument("--out", type=Path, default=None,
                        help="export root, as TOXFLEET_EXPORT_DIR (workers must then be given the same value)")
    args = parser.parse_args(argv)
    if args.out is not None:
        os.environ["TOXFLEET_EXPORT_DIR"] = str(args.out)
    settings = WorkerSettings()
    if args.check:
        try:
            directory, sha = export_location(settings)
            verify_export(directory, sha)
        except ExportError as exc:
            print(f"toxfleet export: {exc}", file=sys.stderr)
            return 1
        print(f"export OK: {directory}")
        return 0
    if args.prepare:
        return prepare(settings, args.texts, args.backends)
    started = time.perf_counter()
    try:
        directory = ensure_export(settings, force=args.force)
    except ExportError as exc:
        print(f"toxfleet export: {exc}", file=sys.stderr)
        return 1
    print(f"export: {directory} ({time.perf_counter() - started:.1f}s)")
    if args.reference or not args.no_gate:
        started = time.perf_counter()
        reference_scores(settings, gate_texts(args.texts or DEFAULT_TEXTS),
                         lambda step: print(f"export: {step}", file=sys.stderr, flush=True))
        print(f"export: reference scores ({time.perf_counter() - started:.1f}s)")
    if args.no_gate:
        return 0
    return gate_cli.main(["--write-decision", *_gate_options(args.texts, args.backends)])


def _gate_options(texts: int | None, backends: list[str] | None) -> list[str]:
    return (([] if texts is None else ["--texts", str(texts)])
            + ([] if backends is None else ["--backends", ",".join(backends)]))


def prepare(settings: WorkerSettings, texts: int | None = None, backends: list[str] | None = None) -> int:
    """Make what `settings.backend` needs, if it is missing; 0 when the workers can start."""
    name = settings.backend
    if name == "auto":
        decision = valid_decision(settings)
        if not isinstance(decision, str):
            print(f"prepare: auto -> {decision.chosen}: cached decision for this checkpoint, CPU and versions "
                  f"(nothing to do)", flush=True)
            return 0
        if settings.runtime_gate:
            print(f"prepare: auto: {decision}; the workers serve with the reference at once and gate this CPU "
                  "in the background (progress in their log, state in /readyz)", flush=True)
            return 0
        print(f"prepare: auto: {decision}; exporting, then gating (minutes on a full-size model)", flush=True)
        return main(_gate_options(texts, backends))
    if name.startswith("onnx"):
        started = time.perf_counter()
        try:
            directory = ensure_export(settings)
        except ExportError as exc:
            print(f"toxfleet export: {exc}", file=sys.stderr)
            return 1
        print(f"prepare: {name}: export {directory} ({time.perf_counter() - started:.1f}s)", flush=True)
        return 0
    print(f"prepare: {name}: nothing to prepare (built from the checkpoint at start)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
