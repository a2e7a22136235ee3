"""Run the whole benchmark and write its results and report: `python -m bench.run [--quick]`.

For each model: the raw model ceiling first (no server), then the baseline alone on the cores, then
toxfleet alone on the same cores, under the same seeded corpus and the same loads:

- closed loop at each client count (each client sends its next text when the previous answer came);
- open loop at fixed Poisson arrival rates, fractions of the capacity just measured for that system
  (its best closed-loop throughput).

Each point is several consecutive windows of the same load; every figure is reported as the median
of the windows with its range. `--rounds N` repeats baseline-then-toxfleet N times (services
restarted), which adds their windows to the same points. Raw results go to a JSON file, which
`bench.report` renders as tables and plots (`python -m bench.report <results.json>` re-renders).

`--quick` is the smoke version CI can run: the tiny checkpoint, short windows, a few seconds a point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from api import UVICORN_OPTIONS
from bench import ceiling as ceiling_mod
from bench import load, report
from bench.checkpoints import ensure_checkpoint, prepare_backend
from bench.cpu import CpuMeter, CpuSnapshot
from bench.environment import environment
from bench.measurement import batch_summary, log_size, window_figures
from bench.profiles import DEFAULT_MODELS, PROFILES, Profile, model_specs
from bench.roofline import usable_cores
from bench.services import ROOT, Service, start_baseline, start_redis, start_toxfleet
from bench.stats import Spread, distribution
from fleet.corpus import DEFAULT_SEED, CommentCorpus
from testing.processes import reap_on_term
from worker.settings import WorkerSettings

SETTLE_CPU = 0.3
"""Cores a service may still use for the next point to start (leftover work from the last one)."""

SETTLE_TIMEOUT = 90.0
"""Longest wait for a service to go quiet between points."""

WARMUP_ATTEMPTS = 30
"""Rounds of warm-up requests a freshly started service gets to answer all of them."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    """One benchmark run: measures points against whichever service is up, collects results."""

    def __init__(self, profile: Profile, corpus: list[str], cores: int, seed: int, lengths: list[int]) -> None:
        self.profile = profile
        self.corpus = corpus
        self.lengths = lengths  # token length of each corpus text, for token-normalised throughput
        self.mean_tokens = sum(lengths) / len(lengths)
        self.cores = cores
        self.seed = seed

    # -- one point -----------------------------------------------------------------------------

    def closed(self, url: str, mode: str, clients: int, meter: CpuMeter, worker_log: Path | None) -> dict[str, Any]:
        p = self.profile

        failures: Counter[str] = Counter()

        async def go() -> load.LoadRun:
            async with load.session(clients + 4) as s:
                call = load.Caller(s, url, mode)
                try:
                    return await load.closed_loop(call, self.corpus, clients, p.warmup, p.windows, p.window,
                                                  meter.snapshot)
                finally:
                    failures.update(call.failures)

        return self._point(go, "closed", mode, {"clients": clients}, "end", worker_log, failures)

    def open(self, url: str, mode: str, fraction: float, capacity: float, meter: CpuMeter,
             worker_log: Path | None) -> dict[str, Any]:
        p = self.profile
        rate = fraction * capacity

        failures: Counter[str] = Counter()

        async def go() -> load.LoadRun:
            async with load.session(load.DEFAULT_MAX_IN_FLIGHT) as s:
                call = load.Caller(s, url, mode, deadline=p.open_deadline)
                try:
                    return await load.open_loop(call, self.corpus, rate, p.warmup, p.windows, p.window,
                                                meter.snapshot, seed=self.seed)
                finally:
                    failures.update(call.failures)

        return self._point(go, "open", mode, {"load": fraction, "rate": rate, "capacity": capacity}, "start",
                           worker_log, failures)

    def _point(self, go: Callable[[], Any], loop: str, mode: str, level: dict[str, Any], by: str,
               worker_log: Path | None, failures: Counter[str]) -> dict[str, Any]:
        offset = log_size(worker_log)
        started = time.monotonic()
        run: load.LoadRun = asyncio.run(go())
        windows = []
        for k in range(len(run.boundaries) - 1):
            samples = load.in_window(run, k, by)
            a: CpuSnapshot = run.probes[k]
            b: CpuSnapshot = run.probes[k + 1]
            windows.append(window_figures(samples, run.boundaries[k + 1] - run.boundaries[k], CpuMeter.between(a, b),
                                          load.in_window(run, k, "end"), self.lengths))
        point = {"loop": loop, "mode": mode, **level, "windows": windows, "outstanding": run.outstanding,
                 "warmup_seconds": run.boundaries[0], "seconds": time.monotonic() - started,
                 "batches": batch_summary(worker_log, offset) if worker_log else None,
                 "failures": dict(failures.most_common(10))}
        tput = Spread.of([w["texts_per_s"] for w in windows])
        p99 = Spread.of([w["p99"] for w in windows])
        errors = sum(w["errors"] for w in windows)
        refused = sum(w["counts"]["refused"] for w in windows)
        log(f"    {loop:6} {mode:8} {_level(point):>12}: {tput.median:7.2f} texts/s "
            f"(range {tput.low:.2f}-{tput.high:.2f}), p99 {p99.median:.3f}s, errors {errors}, refused {refused}")
        for failure, count in failures.most_common(3):
            log(f"      {count} x {failure}")
        return point

    # -- one system ----------------------------------------------------------------------------

    def measure_system(self, system: System) -> list[dict[str, Any]]:
        """Every point of one system, in order; the system is restarted when a point left it busy."""
        running = self._start(system)
        points: list[dict[str, Any]] = []
        try:
            for mode in system.modes:
                closed = []
                for clients in self.profile.clients:
                    running = self._ready(system, running)
                    closed.append(self.closed(running.url, mode, clients, running.meter(), running.worker_log))
                points.extend(closed)
                # Capacity: the best closed-loop throughput (normally at the most clients), token-normalised.
                capacity = max(Spread.of([w["tokens_per_s"] / self.mean_tokens for w in c["windows"]]).median
                               for c in closed)
                if mode not in self.profile.open_modes or not capacity > 0:
                    continue
                for fraction in self.profile.open_loads:
                    running = self._ready(system, running)
                    points.append(self.open(running.url, mode, fraction, capacity, running.meter(),
                                            running.worker_log))
        finally:
            running.stop()
        for point in points:
            point["system"] = system.name
        return points

    def _start(self, system: System) -> Running:
        running = system.start()
        try:
            self._warm(running, system.modes[-1])
        except BaseException:
            running.stop()
            raise
        return running

    def _ready(self, system: System, running: Running) -> Running:
        """The system, quiet: leftover work from the last point (requests its clients gave up on) would
        slow the next one down, so a system that stays busy is restarted."""
        if self._settle(running):
            return running
        log(f"    {system.name} still busy after {SETTLE_TIMEOUT:.0f}s (work left by the last point); restarting it")
        running.stop()
        return self._start(system)

    def _warm(self, running: Running, mode: str) -> None:
        """Until the service answers a concurrent burst in full (every model process loaded)."""
        n = 2 * self.cores

        async def burst() -> list[tuple[str, int | None]]:
            async with load.session(n) as s:
                call = load.Caller(s, running.url, mode, deadline=60)
                return list(await asyncio.gather(*(call(t) for t in self.corpus[:n])))

        for _ in range(WARMUP_ATTEMPTS):
            running.check_alive()
            outcomes = asyncio.run(burst())
            if all(o == load.OK for o, _ in outcomes):
                return
            time.sleep(1)
        raise RuntimeError(f"{running.url} did not answer its warm-up requests: {outcomes}")

    def _settle(self, running: Running) -> bool:
        meter = running.meter()
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while time.monotonic() < deadline:
            running.check_alive()
            a = meter.snapshot()
            time.sleep(1.0)
            if CpuMeter.between(a, meter.snapshot()).service < SETTLE_CPU:
                return True
        return False


@dataclass
class Running:
    """A started system: where it answers, which processes are its CPU, where its worker logs."""

    url: str
    services: list[Service]
    cpu_roots: list[int]
    worker_log: Path | None = None
    cpu_roles: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Root pid -> (its role, its descendants' role), for CPU per process (see `bench.cpu.CpuMeter`)."""

    def meter(self) -> CpuMeter:
        return CpuMeter(self.cpu_roots, self.cpu_roles)

    def check_alive(self) -> None:
        for service in self.services:
            service.check_alive()

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


@dataclass(frozen=True)
class System:
    """A system under test: its name, the modes it is measured in, how to start it."""

    name: str
    modes: tuple[str, ...]
    start: Callable[[], Running]


def baseline_system(ckpt: Path, hf: Path, cores: int, log_dir: Path) -> System:
    def start() -> Running:
        service, url = start_baseline(ckpt, hf, cores, log_dir)
        return Running(url, [service], service.pids, cpu_roles={service.pids[0]: ("server", "server")})

    return System("baseline", ("baseline",), start)


def toxfleet_system(ckpt: Path, hf: Path, cores: int, log_dir: Path, modes: tuple[str, ...],
                    backend: str) -> System:
    def start() -> Running:
        redis, redis_url = start_redis(log_dir)
        try:
            service, url = start_toxfleet(ckpt, hf, cores, redis_url, log_dir, {"TOXFLEET_BACKEND": backend})
        except BaseException:
            redis.stop()
            raise
        # Redis works for toxfleet: its CPU counts as the service's.
        worker, api = service.pids  # as start_toxfleet spawns them
        return Running(url, [redis, service], service.pids + redis.pids, service.logs.get("worker"),
                       {api: ("api", "api"), worker: ("worker main", "pool"), redis.pids[0]: ("redis", "redis")})

    return System("toxfleet", modes, start)


def _level(point: dict[str, Any]) -> str:
    if point["loop"] == "closed":
        return f"{point['clients']} clients"
    return f"{point['load']:.0%} ({point['rate']:.1f}/s)"


def run_model(kind: str, profile: Profile, models_dir: Path, cores: int, rounds: int, seed: int,
              log_dir: Path, systems: list[str], backend: str) -> dict[str, Any]:
    ckpt, hf = ensure_checkpoint(models_dir, kind, log)
    backend_entry = prepare_backend(ckpt, hf, backend, log)
    corpus = CommentCorpus(seed).texts(profile.corpus)
    ws = WorkerSettings()
    log(f"{kind}: raw model ceiling, {cores} processes x 1 thread")
    ceiling = ceiling_mod.measure(ckpt, hf, corpus, cores, profile.ceiling_per_process, profile.ceiling_reference,
                                  profile.ceiling_repeats, ws.pass_tokens, ws.pass_texts, length_texts=corpus,
                                  sweep=profile.ceiling_sweep, log=log)
    lengths = ceiling.pop("lengths")
    entry: dict[str, Any] = {"checkpoint": str(ckpt), "backend": backend_entry, "profile": asdict(profile),
                             "ceiling": ceiling,
                             "tokens": distribution(lengths), "token_lengths": lengths, "points": []}
    bench = Bench(profile, corpus, cores, seed, lengths)
    systems_ = {"baseline": baseline_system(ckpt, hf, cores, log_dir / kind),
                "toxfleet": toxfleet_system(ckpt, hf, cores, log_dir / kind, profile.toxfleet_modes, backend)}
    for r in range(rounds):
        points: list[dict[str, Any]] = []
        for name in systems:
            log(f"{kind}: {name} on {cores} cores, round {r + 1}/{rounds}")
            points += bench.measure_system(systems_[name])
        for point in points:
            point["round"] = r
        entry["points"].extend(points)
    return entry


def main(argv: list[str] | None = None) -> None:
    reap_on_term()  # a killed run (timeout, kill) takes its servers with it
    load.raise_open_files_limit()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny checkpoint, seconds per point")
    parser.add_argument("--models", help="comma list of kind[:profile[:backend]] (default: full: "
                                         f"{DEFAULT_MODELS['full']}; quick: {DEFAULT_MODELS['quick']})")
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    parser.add_argument("--rounds", type=int, default=1, help="times baseline then toxfleet are started and measured")
    parser.add_argument("--windows", type=int, help="override the profile's windows per point")
    parser.add_argument("--window", type=float, help="override the profile's seconds per window")
    parser.add_argument("--ceiling-texts", type=int, help="override the profile's texts per ceiling process")
    parser.add_argument("--backend", default="torch",
                        help="toxfleet's TOXFLEET_BACKEND (default torch: fp32, the backend of the baseline and "
                             "the ceiling, which the targets are about)")
    parser.add_argument("--systems", default="baseline,toxfleet", help="systems to measure (for development; the "
                                                                       "report's ratios need both)")
    parser.add_argument("--clients", help="override the profile's closed-loop client counts, e.g. 1,10,100")
    parser.add_argument("--cores", type=int, default=None, help="processes per system (default: physical cores)")
    parser.add_argument("--clock-ghz", type=float, default=None, help="CPU clock for the peak (default: /proc/cpuinfo)")
    parser.add_argument("--fma-units", type=int, default=2, help="FMA units per core for the peak")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, help="results JSON (default: docs/benchmarks/results.json; "
                                                 "quick: var/bench-quick/results.json)")
    parser.add_argument("--report", type=Path, help="markdown report (default: docs/benchmarks.md; "
                                                    "quick: var/bench-quick.md)")
    args = parser.parse_args(argv)
    if not set(args.systems.split(",")) <= {"baseline", "toxfleet"}:
        parser.error("--systems takes baseline and/or toxfleet")
    # Stopped from outside (CI timeout, kill): unwind, so the services this run started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    name = "quick" if args.quick else "full"
    out = args.out or (ROOT / ("var/bench-quick/results.json" if args.quick else "docs/benchmarks/results.json"))
    md = args.report or out.parent.parent / f"{out.parent.name}.md"
    cores = args.cores or usable_cores()
    log_dir = ROOT / "var" / "bench-logs" / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {"meta": {"profile": name, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                        "seed": args.seed, "rounds": args.rounds, "logs": str(log_dir),
                                        "toxfleet_backend": args.backend, "api_options": list(UVICORN_OPTIONS),
                                        **environment(cores, args.clock_ghz, args.fma_units)},
                               "models": {}}
    results["meta"]["worker_settings"]["backend"] = args.backend
    started = time.monotonic()
    for kind, profile_name, model_backend in model_specs(args.models or DEFAULT_MODELS[name], name, args.backend):
        profile = PROFILES[profile_name]
        if args.windows:
            profile = replace(profile, windows=args.windows)
        if args.window:
            profile = replace(profile, window=args.window)
        if args.clients:
            profile = replace(profile, clients=tuple(int(c) for c in args.clients.split(",")))
        if args.ceiling_texts:
            profile = replace(profile, ceiling_per_process=args.ceiling_texts,
                              ceiling_reference=min(profile.ceiling_reference, args.ceiling_texts))
        results["models"][kind] = run_model(kind, profile, args.models_dir, cores, args.rounds, args.seed, log_dir,
                                            systems=args.systems.split(","), backend=model_backend)
        _save(results, started, out)
    _save(results, started, out)
    report.render(results, md, out.parent, os.path.relpath(out, ROOT))
    log(f"results: {out}; report: {md} ({time.monotonic() - started:.0f}s in all)")


def _save(results: dict[str, Any], started: float, out: Path) -> None:
    results["meta"]["seconds"] = time.monotonic() - started
    results["meta"]["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compact: the raw latencies are most of it, and one number per line would be ten thousand lines.
    out.write_text(json.dumps(results, separators=(",", ":"), allow_nan=True) + "\n")


if __name__ == "__main__":
    main()
