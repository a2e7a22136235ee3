"""Ahead-of-time ONNX export and int8 quantization of a Detoxify checkpoint, then the fidelity gate.

Workers never export: they load what this command built (`worker.exports`), and refuse an export
that is missing, stale or corrupt with one line naming this command. It rebuilds what is missing or
stale, runs the fidelity gate on this CPU (`worker.gate`) and writes the decision that
`TOXFLEET_BACKEND=auto` reads:

    python -m worker.export                # reads TOXFLEET_CHECKPOINT / TOXFLEET_HF_CONFIG / TOXFLEET_MODEL
    python -m worker.export --check        # verify only; exit 1 with the reason if a worker would refuse it
    python -m worker.export --no-gate      # artifacts only (the gate needs minutes on a full-size model)

This module is an entry point on top of `worker.exports` and `worker.gate`; nothing imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from worker.exports.artifacts import ExportError, export_location, verify_export
from worker.exports.build import ensure_export
from worker.gate import cli as gate_cli
from worker.settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="verify the export only; exit 1 if a worker would refuse it")
    parser.add_argument("--force", action="store_true", help="rebuild even if the export is current")
    parser.add_argument("--no-gate", action="store_true", help="skip the fidelity gate and the auto decision")
    parser.add_argument("--texts", type=int, default=None, help="gate corpus size (default: worker.gate's)")
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
    started = time.perf_counter()
    try:
        directory = ensure_export(settings, force=args.force)
    except ExportError as exc:
        print(f"toxfleet export: {exc}", file=sys.stderr)
        return 1
    print(f"export: {directory} ({time.perf_counter() - started:.1f}s)")
    if args.no_gate:
        return 0
    return gate_cli.main(["--write-decision"] + ([] if args.texts is None else ["--texts", str(args.texts)]))


if __name__ == "__main__":
    sys.exit(main())
