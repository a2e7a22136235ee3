"""The fidelity gate: every backend against the torch fp32 reference, on a fixed corpus
(`worker.gate.fidelity` says what is measured and the budgets).

**Random weights are not trained weights.** The synthetic checkpoints (`tools.synthetic`) have
nearly constant features that a large classifier spreads over (0, 1), so they amplify any rounding:
quantized backends fail on them by a wide margin. A trained checkpoint has different error
statistics; gate the real one:

    TOXFLEET_CHECKPOINT=real.ckpt TOXFLEET_HF_CONFIG=hf/ python -m worker.gate --write-decision
    python -m worker.gate --require onnx          # exit 1 unless `onnx` passes (CI)
    python -m worker.gate --full --json rows.json # judge every candidate on every text (docs' tables)
    python -m worker.gate --timing gate.json      # also record where the gate spent its time

The reference's scores come from the export directory when `python -m worker.export` kept them for
this checkpoint and corpus (`worker.gate.reference`); candidates are timed first and only those that
could still be chosen are judged for fidelity (`worker.gate.fidelity.run_gate`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from worker.backends import registry
from worker.gate.compare import RANK_FLOOR
from worker.gate.decision import Decision
from worker.gate.fidelity import CANDIDATES, DEFAULT_TEXTS, NOT_JUDGED, GateRow, gate_texts, run_gate
from worker.gate.record import GateRecord
from worker.onnx_export.artifacts import export_location
from worker.onnx_export.build import ensure_export
from worker.settings import WorkerSettings


def backend_list(value: str) -> list[str]:
    """`--backends`' value as candidate names (the reference, always gated, dropped); a typo is a usage error."""
    names = [b for b in value.split(",") if b and b != "torch"]
    unknown = [b for b in names if b not in registry.all_candidates()]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not among {', '.join(registry.all_candidates())}")
    return names


def choose(rows: Sequence[GateRow]) -> str:
    """The fastest backend that passed (the reference always may be chosen if it passed its check)."""
    passed = [row for row in rows if row.passed and row.error is None]
    if not passed:
        raise RuntimeError("no backend passed the fidelity gate, not even the reference")
    return max(passed, key=lambda row: row.texts_per_s).backend


def format_table(rows: Sequence[GateRow]) -> str:
    reference_rate = rows[0].texts_per_s if rows else 0.0
    lines = ["| backend | precision | texts | max abs | p99 abs | flips (worst threshold) | min Spearman "
             f"(ref >= {RANK_FLOOR:g}) | budget (max / p99 / flips / rank) | gate | texts/s | x torch | load s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.texts_per_s / reference_rate:.2f}" if reference_rate and row.texts_per_s else "-"
        gate = "pass" if row.passed else ("FAIL" if row.error is None else f"FAIL: {row.error}")
        if row.stopped:
            gate += f" ({row.stopped})"
        if not row.judged:
            gate = row.error or NOT_JUDGED
        fidelity = (f"{row.max_abs:.2e} | {row.p99_abs:.2e} | {row.flips} ({row.flip_fraction:.2%}) | "
                    f"{row.min_spearman:.5f}") if row.judged and row.error is None else "- | - | - | -"
        lines.append(f"| {row.backend} | {row.precision} | {row.texts} | {fidelity} | {row.budget_max_abs:g} / "
                     f"{row.budget_p99_abs:g} / {row.budget_flip_fraction:.1%} / {row.budget_min_spearman:g} "
                     f"| {gate} | {row.texts_per_s:.1f} | {ratio} | {row.load_seconds:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=DEFAULT_TEXTS, help=f"corpus size (default {DEFAULT_TEXTS})")
    parser.add_argument("--backends", type=backend_list, default=list(CANDIDATES),
                        help="comma-separated backends to gate (default: those gated on this CPU)")
    parser.add_argument("--require", default="", help="comma-separated backends that must pass (exit 1 otherwise)")
    parser.add_argument("--write-decision", action="store_true",
                        help="record the table and the fastest passing backend for TOXFLEET_BACKEND=auto")
    parser.add_argument("--decision-file", type=Path,
                        help="write the decision to this file instead of the export directory (implies "
                             "--write-decision): the runtime gate's, where the image's export directory is read-only")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--full", action="store_true",
                        help="judge every candidate's fidelity on every text, even one that cannot be chosen")
    parser.add_argument("--no-reference-cache", dest="reference_cache", action="store_false",
                        help="score the corpus with the reference here; neither read nor keep its scores")
    parser.add_argument("--timing", type=Path,
                        help="also write where the gate spent its time (steps, seconds) as JSON here")
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    backends = args.backends
    required = [b for b in args.require.split(",") if b]
    write = args.write_decision or args.decision_file is not None
    if write or any(b.startswith("onnx") for b in backends):
        ensure_export(settings)
    record = GateRecord()
    rows = run_gate(settings, backends, gate_texts(args.texts),
                    lambda step: print(f"gate: {step}", file=sys.stderr, flush=True),
                    full=args.full, judge=required, cache=args.reference_cache, record=record)
    print(format_table(rows))
    print(f"gate: {record.seconds:.0f} s, {record.cpu_seconds:.0f} s of CPU (reference scores {record.reference})",
          file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if args.timing:
        args.timing.write_text(json.dumps({**asdict(record), "texts": args.texts, "backends": backends,
                                           "full": args.full, "threads": settings.torch_threads}, indent=2))
    status = 0
    if not rows[0].passed:
        print("fidelity: the reference's padded passes differ from unpadded scoring", file=sys.stderr)
        status = 1
    for name in required:
        if not any(r.backend == name and r.passed for r in rows):
            print(f"fidelity: required backend {name} did not pass", file=sys.stderr)
            status = 1
    if write:
        directory, sha = export_location(settings)
        decision = Decision(checkpoint_sha256=sha, chosen=choose(rows), rows=[asdict(r) for r in rows],
                            threads=settings.torch_threads, texts=args.texts)
        path = decision.write(directory) if args.decision_file is None else decision.write_file(args.decision_file)
        print(f"auto -> {decision.chosen} (written to {path})")
    return status
