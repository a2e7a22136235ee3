"""What the fidelity gate costs on one checkpoint: the old full gate against the runtime gate, back to back.

    python -m bench.gate_cost --checkpoint models/trained/model.ckpt --hf models/trained/hf --json var/gate-cost.json

Each variant runs as its own `python -m worker.gate` process, in turn, `--rounds` times:

- `full`: what every gate did before the reference's scores were kept: the reference scores the corpus
  here (`--no-reference-cache`) and every candidate is judged on every text (`--full`);
- `runtime`: what a gate on a new CPU does now: the reference's kept scores (made once, at export),
  candidates timed first, judged fastest first while they could still be chosen.

The export and the kept reference scores are made first (untimed here: the image build's cost; the
reference's own time is recorded as the export made it). Wall time is the process's, start to exit;
each gate's `--timing` record says where it went. CPU time (user + system of the gate process, which
runs one thread by default) is recorded beside it: on a shared machine it is the steadier figure, close
to the wall time the same gate takes on an idle core. Report the machine's load with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.services import ROOT

VARIANTS = {
    "full": ["--full", "--no-reference-cache"],
    "runtime": [],
}


def _env(checkpoint: Path, hf: Path, exports: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update(TOXFLEET_CHECKPOINT=str(checkpoint.resolve()), TOXFLEET_HF_CONFIG=str(hf.resolve()), HF_HUB_OFFLINE="1")
    if exports is not None:
        env["TOXFLEET_EXPORT_DIR"] = str(exports.resolve())
    return env


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', platform.processor()).strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def run_variant(name: str, env: dict[str, str], texts: int, backends: str | None, work: Path, round_: int
                ) -> dict[str, Any]:
    """One gate process of `name`; its wall time, its timing record, its table's verdicts."""
    timing, rows = work / f"{name}-{round_}-timing.json", work / f"{name}-{round_}-rows.json"
    command = [sys.executable, "-m", "worker.gate", "--texts", str(texts), "--timing", str(timing),
               "--json", str(rows), *VARIANTS[name], *(["--backends", backends] if backends else [])]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{name} gate failed ({done.returncode}): {done.stderr[-3000:]}")
    table = json.loads(rows.read_text())
    return {"variant": name, "round": round_, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_average": os.getloadavg(), "timing": json.loads(timing.read_text()),
            "rows": [{k: r[k] for k in ("backend", "passed", "texts", "texts_per_s", "error", "judged", "stopped")}
                     for r in table]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--exports", type=Path, default=None, help="TOXFLEET_EXPORT_DIR (default: next to it)")
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--backends", default=None, help="gate only these (default: all candidates)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="full,runtime")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    env = _env(args.checkpoint, args.hf, args.exports)
    work = args.json.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    export = subprocess.run([sys.executable, "-m", "worker.export", "--no-gate", "--texts", str(args.texts)],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    if export.returncode != 0:
        raise RuntimeError(f"export failed: {export.stderr[-3000:]}")
    result: dict[str, Any] = {
        "checkpoint": str(args.checkpoint), "texts": args.texts, "cpu": _cpu(), "load_average": os.getloadavg(),
        "export_and_reference_s": round(time.perf_counter() - started, 1),
        "export_and_reference_cpu_s": round(sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f)
                                                - getattr(before, f) for f in ("ru_utime", "ru_stime")), 1),
        "export_log": [line for line in export.stderr.splitlines() if "reference" in line][-2:], "runs": []}
    for round_ in range(args.rounds):
        for name in args.variants.split(","):
            run = run_variant(name, env, args.texts, args.backends, work, round_)
            print(f"{name} round {round_}: {run['wall_s']:.0f} s wall, {run['cpu_s']:.0f} s CPU", file=sys.stderr,
                  flush=True)
            result["runs"].append(run)
            args.json.write_text(json.dumps(result, indent=2))
    result["summary"] = {}
    for name in args.variants.split(","):
        runs = [r for r in result["runs"] if r["variant"] == name]
        if runs:
            result["summary"][name] = {
                f"{what}_{stat}": round(fn([r[f"{what}_s"] for r in runs]), 1)
                for what in ("wall", "cpu") for stat, fn in (("median_s", statistics.median), ("min_s", min),
                                                            ("max_s", max))} | {"n": len(runs)}
    result["load_average_after"] = os.getloadavg()
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
