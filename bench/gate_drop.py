"""How much serving throughput a runtime fidelity gate takes while it runs beside the workers.

    python -m bench.gate_drop --checkpoint models/trained/model.ckpt --hf models/trained/hf --json var/gate-drop.json

One fleet (a private Redis, one worker with a process per core on `torch` set by name, so it never
gates by itself, and the API) under a closed loop of `--clients` one-text jobs. In one run, on the
same processes and corpus, windows of `--window` seconds in three phases:

- `alone`: the fleet serving, nothing else;
- `gating`: the same, with the runtime gate's own subprocess running beside it as a worker starts it
  (`nice -n TOXFLEET_GATE_NICE python -m worker.gate --decision-file F`, the worker's environment,
  its threads per process); the windows stop when the gate ends, or after `--windows` of them;
- `after`: the fleet alone again, once the gate has ended or been stopped.

Reported: completed texts/s per window, median and range per phase, `gating` / `alone`, and where the
gate had got to when its windows ended (its exit status and last progress line): at nice 19 beside a
saturated fleet it gets little CPU, by design, so it may still be timing its first candidates. The gate's
export and kept reference scores are made before the load starts (the image build's part), so the
windows see what a worker on a new CPU kind runs: timing, then judging. CPU count and load are
recorded with the figures; on a shared machine the ratio is indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load import OK, Caller, closed_loop, in_window, session
from fleet.corpus import CommentCorpus
from testing import RedisServer, base_env, free_port, start_api, start_worker
from testing.processes import reap_on_term
from worker.cpus import cpu_model_name, kernel_signature

PHASES = ("alone", "gating", "after")


def _gate_command(decision: Path, texts: int | None, backends: str | None, nice: int) -> list[str]:
    argv = [sys.executable, "-m", "worker.gate", "--decision-file", str(decision)]
    argv += ["--texts", str(texts)] if texts else []
    argv += ["--backends", backends] if backends else []
    return ([shutil.which("nice") or "nice", "-n", str(nice)] + argv)


def _summary(rates: list[float]) -> dict[str, float] | None:
    if not rates:
        return None
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "windows": len(rates)}


async def _phase(url: str, texts: list[str], clients: int, window: float, windows: int,
                 until: Any = None) -> list[float]:
    """Completed texts/s in each window of a closed loop; with `until` (a process), only while it runs."""
    rates: list[float] = []
    async with session(clients + 8) as http:
        call = Caller(http, url, "jobs")
        for _ in range(windows):
            if until is not None and until.poll() is not None:
                break
            run = await closed_loop(call, texts, clients, warmup=0.5, windows=1, window=window,
                                    probe=time.monotonic, max_warmup=30.0)
            done = [s for s in in_window(run, 0, "end") if s.outcome == OK]
            rates.append(len(done) / (run.boundaries[1] - run.boundaries[0]))
            print(f"  {len(rates)}: {rates[-1]:.2f} texts/s", flush=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    reap_on_term()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("models/trained/model.ckpt"))
    parser.add_argument("--hf", type=Path, default=None, help="HF config dir (default: next to the checkpoint)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--windows", type=int, default=4, help="windows per phase (the gating phase: at most)")
    parser.add_argument("--concurrency", type=int, default=len(os.sched_getaffinity(0)),
                        help="worker processes (default: the CPUs available)")
    parser.add_argument("--gate-texts", type=int, default=None, help="the gate's corpus (default: its own)")
    parser.add_argument("--gate-backends", default=None, help="the gate's candidates (default: this CPU's)")
    parser.add_argument("--gate-nice", type=int, default=19, help="as TOXFLEET_GATE_NICE (default 19)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    checkpoint = (args.checkpoint.resolve(), (args.hf or args.checkpoint.parent / "hf").resolve())
    if not checkpoint[0].is_file():
        raise SystemExit(f"no checkpoint at {checkpoint[0]}")
    texts = CommentCorpus(7).texts(2000)
    rates: dict[str, list[float]] = {p: [] for p in PHASES}
    gate_seconds, gate_end = None, None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        exports = tmp / "exports"
        server = RedisServer(free_port(), tmp)
        server.start()
        procs = []
        try:
            env = {"TOXFLEET_BACKEND": "torch", "TOXFLEET_EXPORT_DIR": str(exports), "TOXFLEET_CACHE": "false"}
            # In this process's session, as the gate started below: with the scheduler's autogroups
            # (sched_autogroup_enabled), nice only ranks processes of one session, and a worker's own
            # runtime gate is its child, in its session. In sessions of their own the nice-19 gate
            # would get a full autogroup's share, half the CPU beside the worker.
            worker = start_worker(tmp, server.url, checkpoint, name="gate-drop", concurrency=args.concurrency,
                                  env=env, own_session=False)
            api, url = start_api(tmp, server.url, name="gate-drop-api")
            procs += [worker, api]
            gate_env = {**base_env(server.url, checkpoint), **env, "TOXFLEET_BACKEND": "auto"}
            print("export and kept reference scores (untimed: the image build's part)", flush=True)
            subprocess.run([sys.executable, "-m", "worker.export", "--no-gate"]
                           + (["--texts", str(args.gate_texts)] if args.gate_texts else []),
                           env=gate_env, check=True, capture_output=True, timeout=7200)
            print("alone", flush=True)
            rates["alone"] = asyncio.run(_phase(url, texts, args.clients, args.window, args.windows))
            print("gating", flush=True)
            log = (tmp / "gate.log").open("w")
            started = time.monotonic()
            gate = subprocess.Popen(_gate_command(tmp / "decision.json", args.gate_texts, args.gate_backends,
                                                  args.gate_nice), env=gate_env, stdout=log, stderr=log)
            try:
                rates["gating"] = asyncio.run(_phase(url, texts, args.clients, args.window, args.windows, gate))
            finally:
                if gate.poll() is None:
                    gate.terminate()
                gate.wait(60)
                gate_seconds = time.monotonic() - started
                log.close()
                lines = (tmp / "gate.log").read_text().splitlines()
                gate_end = f"exit {gate.returncode}; last line: {lines[-1] if lines else '-'}"
            print("after", flush=True)
            rates["after"] = asyncio.run(_phase(url, texts, args.clients, args.window, args.windows))
        finally:
            for p in reversed(procs):
                p.stop()
            server.stop()

    summary = {p: _summary(r) for p, r in rates.items()}
    alone, gating = summary["alone"], summary["gating"]
    ratio = gating["median"] / alone["median"] if alone and gating else None
    cpu = f"{cpu_model_name()} ({kernel_signature()}), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    print(f"\n{checkpoint[0].parent.name}, {args.concurrency} worker processes, {args.clients} clients, "
          f"{args.window:g} s windows, gate at nice {args.gate_nice}; {cpu}")
    for phase, s in summary.items():
        print(f"{phase:<8} " + (f"{s['median']:8.2f} texts/s ({s['min']:.2f}-{s['max']:.2f}, {s['windows']} windows)"
                                if s else "no window"))
    if ratio is not None:
        print(f"gating / alone: {ratio:.2f}x (the gate ran {gate_seconds:.0f} s from its start to the end of the "
              f"gating windows; {gate_end})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
                                         "summary": summary, "gating_vs_alone": ratio,
                                         "gate_seconds": gate_seconds, "gate_end": gate_end, "cpu": cpu}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
