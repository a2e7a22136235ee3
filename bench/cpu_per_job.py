"""CPU per job, per process, of toxfleet's serving path: `python -m bench.cpu_per_job`.

Starts a private Redis and toxfleet (as `bench.services.start_toxfleet` does: one Uvicorn API, one
Celery worker with its pool, optionally Flower), drives a steady closed loop of one-text jobs, and
over fixed windows reads each process's CPU seconds from /proc (utime + stime) and Redis's
`INFO commandstats`, then divides by the jobs completed in the window:

    API (uvicorn) | worker main | pool (all processes) | Flower | redis-server | load generator

Variants change only the environment or the command lines (never the code), so a configuration's
effect shows side by side with the default, in the same minute, on the same cores. `--revs A,B`
runs every variant on the code of each git revision instead of the working tree (each exported to a
temporary directory, which the processes start in), interleaved, so a commit's effect shows the same way:

    python -m bench.cpu_per_job --variants default,warning --repeats 2
    python -m bench.cpu_per_job --revs HEAD~1,HEAD --repeats 3
    python -m bench.cpu_per_job --variants default --profile var/profiles   # py-spy every process

`--profile DIR` also records each process with py-spy (raw collapsed stacks, one file per process)
during the first window; profiling costs CPU, so the figures of a profiled run are not comparable
with the others. `--list` names the variants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api import UVICORN_OPTIONS
from bench import load
from bench.cpu import process_seconds, process_tree
from bench.services import ROOT, Service, _bin, free_port, http_json, model_env, start_redis
from fleet.corpus import DEFAULT_SEED, CommentCorpus
from testing.processes import reap_on_term


@dataclass(frozen=True)
class Variant:
    """A configuration: extra environment, extra worker / API arguments, Flower or not."""

    env: dict[str, str] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    api_args: tuple[str, ...] = ()
    flower: bool = False
    about: str = ""
    hide: tuple[str, ...] = ()
    """Modules the processes cannot import (a stub that raises ImportError, first on PYTHONPATH):
    shows what an optional accelerator such as hiredis is worth, with the same venv on both sides."""

QUIET = ("--loglevel=WARNING",)

VARIANTS: dict[str, Variant] = {
    "default": Variant(about="as bench.services.start_toxfleet starts it"),
    "flower": Variant(flower=True, about="default + Flower consuming the task events"),
    "asyncio-h11": Variant(api_args=("--loop", "asyncio", "--http", "h11"),
                           about="uvicorn on the stdlib loop and h11 (what `auto` picks without uvicorn[standard])"),
    "uvloop-httptools": Variant(api_args=("--loop", "uvloop", "--http", "httptools"), about="explicit"),
    "asyncio-httptools": Variant(api_args=("--loop", "asyncio", "--http", "httptools"),
                                 about="the stdlib loop, which accepts every waiting connection at once (libuv "
                                       "accepts one per loop iteration), and httptools"),
    "warning": Variant(worker_args=QUIET, api_args=("--log-level", "warning", "--log-config", "@quiet"),
                       about="worker --loglevel=WARNING; API: uvicorn, api.* and toxfleet.* loggers at WARNING"),
    "no-gossip": Variant(worker_args=("--without-gossip", "--without-mingle", "--without-heartbeat"),
                         about="no worker gossip, mingle, heartbeat"),
    "no-metrics": Variant(env={"TOXFLEET_METRICS_PORT": "0", "TOXFLEET_API_METRICS_PORT": "0"},
                          about="Prometheus off in the worker (multiprocess files) and the API"),
    "no-hiredis": Variant(hide=("hiredis",), about="redis-py's pure-Python RESP parser instead of hiredis"),
    "one-process": Variant(env={"TOXFLEET_CONCURRENCY": "1"},
                           about="a pool of one process: batches twice as large at the same load"),
    "pass-8192": Variant(env={"TOXFLEET_PASS_TOKENS": "8192"},
                         about="forward passes of up to 8192 padded tokens (16 full-length texts) instead of 1024"),
    "cache-on": Variant(env={"TOXFLEET_CACHE": "true"}, about="score cache on (corpus cycles: mostly hits)"),
    "all-off": Variant(env={"TOXFLEET_METRICS_PORT": "0", "TOXFLEET_API_METRICS_PORT": "0"},
                       worker_args=QUIET + ("--without-gossip", "--without-mingle", "--without-heartbeat"),
                       api_args=("--log-level", "warning", "--log-config", "@quiet"),
                       about="warning + no-gossip + no-metrics"),
}

QUIET_LOG_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "loggers": {name: {"level": "WARNING"} for name in ("api", "toxfleet", "uvicorn", "uvicorn.error")},
}
"""`--log-config @quiet`: the API's own INFO lines off (`api.main` sets only the root level; its
per-job lines have been DEBUG since issue 11's third round, so `warning` now mostly quiets the worker)."""

ROLES = ("api", "worker_main", "pool", "flower", "redis", "loadgen")


def start(variant: Variant, ckpt: Path, hf: Path, concurrency: int, redis_url: str,
          log_dir: Path, tree: Path = ROOT) -> tuple[Service, str, dict[str, int]]:
    """toxfleet as `bench.services.start_toxfleet` starts it, with the variant's changes, running the
    code in `tree` (Uvicorn and Celery import the app from their working directory first)."""
    port = free_port()
    path = [str(tree)]
    if variant.hide:
        stubs = log_dir / "hidden-modules"
        for module in variant.hide:
            (stubs / module).mkdir(parents=True, exist_ok=True)
            (stubs / module / "__init__.py").write_text(f"raise ImportError('{module} hidden by the bench variant')\n")
        path.insert(0, str(stubs))
    env = {**model_env(ckpt, hf), "REDIS_URL": redis_url, "TOXFLEET_CONCURRENCY": str(concurrency),
           "TOXFLEET_METRICS_PORT": str(free_port()), "TOXFLEET_API_METRICS_PORT": str(free_port()),
           "TOXFLEET_API_KEYS": "", "TOXFLEET_RATE_LIMIT": "0",
           "TOXFLEET_CACHE": "false", "PYTHONPATH": os.pathsep.join(path), **variant.env}
    service = Service("toxfleet", log_dir)
    quiet = log_dir / "quiet-logging.json"
    quiet.write_text(json.dumps(QUIET_LOG_CONFIG))
    api_args = [str(quiet) if a == "@quiet" else a for a in variant.api_args]
    worker = service.spawn("worker", [_bin("celery"), "-A", "worker", "worker", "--loglevel=INFO",
                                      *variant.worker_args, "--hostname", f"bench-{port}@%h"], env=env, cwd=tree)
    api = service.spawn("api", [_bin("uvicorn"), "api.main:app", "--host", "127.0.0.1", "--port", str(port),
                                *UVICORN_OPTIONS, "--no-access-log", *api_args], env=env, cwd=tree)
    roots = {"worker": worker.pid, "api": api.pid}
    if variant.flower:
        flower = service.spawn("flower", [_bin("celery"), "-A", "worker", "flower", f"--port={free_port()}",
                                          "--address=127.0.0.1"], env=env, cwd=tree)
        roots["flower"] = flower.pid
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        status, body = http_json(f"{url}/readyz")
        return status == 200 and isinstance(body, dict) and int(body.get("workers", 0)) >= 1

    service.wait_until("toxfleet API and worker", ready)
    return service, url, roots


def roles_of(roots: dict[str, int], redis_pid: int) -> dict[int, str]:
    """pid -> role for every process of the system now alive."""
    roles: dict[int, str] = {redis_pid: "redis"}
    for pid in process_tree([roots["api"]]):
        roles[pid] = "api"
    if "flower" in roots:
        for pid in process_tree([roots["flower"]]):
            roles[pid] = "flower"
    for pid in process_tree([roots["worker"]]):
        roles[pid] = "worker_main" if pid == roots["worker"] else "pool"
    return roles


def cpu_by_role(roles: dict[int, str]) -> dict[str, float]:
    out = dict.fromkeys(ROLES, 0.0)
    for pid, role in roles.items():
        out[role] += process_seconds(pid)
    out["loadgen"] = time.process_time()
    return out


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, check=True).stdout


def commandstats(port: int) -> dict[str, int]:
    calls: dict[str, int] = {}
    for line in redis_cli(port, "info", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            calls[name] = int(dict(kv.split("=") for kv in rest.split(","))["calls"])
    return calls


def pyspy(pids: dict[int, str], seconds: int, out_dir: Path, rate: int,
          extra: tuple[str, ...] = ()) -> list[subprocess.Popen[bytes]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for pid, role in sorted(pids.items()):
        if role == "redis":
            continue
        target = out_dir / f"{role}-{pid}.txt"
        procs.append(subprocess.Popen([_bin("py-spy"), "record", "-r", str(rate), "-d", str(seconds), "-f", "raw",
                                       "-p", str(pid), "-o", str(target), *extra],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


async def measure(url: str, mode: str, texts: list[str], clients: int, warmup: float, windows: int, window: float,
                  snapshot: Any) -> tuple[list[load.Sample], list[float], list[Any]]:
    async with load.session(clients) as http:
        caller = load.Caller(http, url, mode)
        run = await load.closed_loop(caller, texts, clients, warmup, windows, window, snapshot, ramp=0.5)
    return run.samples, run.boundaries, run.probes


def run_variant(name: str, variant: Variant, args: argparse.Namespace, texts: list[str],
                profile_dir: Path | None, tree: Path = ROOT) -> list[dict[str, Any]]:
    log_dir = Path(tempfile.mkdtemp(prefix=f"cpj-{name}-"))
    redis_service, redis_url = start_redis(log_dir)
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    try:
        service, url, roots = start(variant, args.checkpoint, args.hf, args.concurrency, redis_url, log_dir, tree)
        with service:
            roles = roles_of(roots, redis_service.pids[0])
            spies: list[subprocess.Popen[bytes]] = []

            def snapshot() -> tuple[float, dict[str, float], dict[str, int], str]:
                if profile_dir is not None and not spies:
                    spies.extend(pyspy(roles, int(args.window), profile_dir / name, args.rate,
                                       tuple(args.spy_args.split())))
                return (time.monotonic(), cpu_by_role(roles), commandstats(redis_port),
                        subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())

            samples, bounds, probes = asyncio.run(
                measure(url, args.mode, texts, args.clients, args.warmup, args.windows, args.window, snapshot))
            for spy in spies:
                spy.wait(timeout=args.window + 30)
    finally:
        redis_service.stop()
    rows = []
    for k in range(len(bounds) - 1):
        (t0, cpu0, cmd0, _), (t1, cpu1, cmd1, up) = probes[k], probes[k + 1]
        done = [s for s in samples if bounds[k] <= s.end < bounds[k + 1]]
        ok = sum(1 for s in done if s.outcome == load.OK)
        wall = t1 - t0
        jobs = max(ok, 1)
        cpu_ms = {r: 1000 * (cpu1[r] - cpu0[r]) / jobs for r in ROLES}
        cmds = {c: (n - cmd0.get(c, 0)) / jobs for c, n in cmd1.items() if n - cmd0.get(c, 0) > 0}
        lat = sorted(s.latency for s in done if s.outcome == load.OK) or [0.0]
        rows.append({"variant": name, "window": k, "jobs": ok, "errors": len(done) - ok, "texts_per_s": ok / wall,
                     "p50_ms": 1000 * lat[len(lat) // 2], "cpu_ms": cpu_ms,
                     "server_ms": sum(v for r, v in cpu_ms.items() if r != "loadgen"), "redis_cmds": cmds,
                     "uptime": up})
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | runs | texts/s median [range] | server CPU ms/job median [range] | "
             + " | ".join(ROLES) + " | redis cmds/job | load avg (1 min) |", "|---" * (6 + len(ROLES)) + "|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        tps = [r["texts_per_s"] for r in mine]
        med = {role: statistics.median(r["cpu_ms"][role] for r in mine) for role in ROLES}
        cmds = statistics.median(sum(r["redis_cmds"].values()) for r in mine)
        server = [r["server_ms"] for r in mine]
        loads = [load_average(r["uptime"]) for r in mine]
        lines.append(f"| {name} | {len(mine)} | {statistics.median(tps):.0f} [{min(tps):.0f}-{max(tps):.0f}] | "
                     f"{statistics.median(server):.2f} [{min(server):.2f}-{max(server):.2f}] | "
                     + " | ".join(f"{med[role]:.2f}" for role in ROLES)
                     + f" | {cmds:.1f} | {statistics.median(loads):.1f} [{min(loads):.1f}-{max(loads):.1f}] |")
    return "\n".join(lines)


def export_tree(rev: str) -> Path:
    """The files of git revision `rev` in a fresh temporary directory (the checkpoints stay in ROOT)."""
    out = Path(tempfile.mkdtemp(prefix=f"cpj-tree-{rev.replace('/', '_')}-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def load_average(uptime: str) -> float:
    return float(uptime.rsplit("load average:", 1)[1].split(",")[0])


def main() -> None:
    reap_on_term()  # a killed run (timeout, kill) takes its servers with it
    load.raise_open_files_limit()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="default")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all variants (interleaved)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--mode", default="jobs", choices=("jobs", "compat"))
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "models/tiny/model.ckpt")
    parser.add_argument("--hf", type=Path, default=ROOT / "models/tiny/hf")
    parser.add_argument("--profile", type=Path, help="py-spy every process into this directory (first window)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--spy-args", default="--gil",
                        help="more py-spy options; --gil (default) samples only the thread holding the GIL, "
                             "a proxy for the CPU the interpreter uses; '' for wall-clock stacks")
    parser.add_argument("--json", type=Path, help="append every window's figures here")
    parser.add_argument("--revs", metavar="A,B",
                        help="run every variant on each of these git revisions' code, interleaved (as NAME@REV)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for name, v in VARIANTS.items():
            print(f"{name:18} {v.about}")
        return
    texts = CommentCorpus(DEFAULT_SEED).texts(500)
    trees = {f"@{rev}": export_tree(rev) for rev in args.revs.split(",")} if args.revs else {"": ROOT}
    runs = [(name + suffix, name, tree) for name in args.variants.split(",") for suffix, tree in trees.items()]
    rows: list[dict[str, Any]] = []
    for rnd in range(args.repeats):
        for label, name, tree in runs:
            print(f"[cpu_per_job {time.strftime('%H:%M:%S')}] round {rnd + 1}: {label}", file=sys.stderr, flush=True)
            got = run_variant(label, VARIANTS[name], args, texts, args.profile, tree)
            rows.extend(got)
            for r in got:
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                  if k != "redis_cmds"}), file=sys.stderr, flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                with open(args.json, "a") as out:
                    for r in got:
                        out.write(json.dumps(r) + "\n")
    print(summarize(rows))


if __name__ == "__main__":
    main()
