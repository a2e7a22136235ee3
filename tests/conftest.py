"""Shared fixtures: real processes (Redis, Celery workers, uvicorn, Flower) on private ports.

Every test session starts its own `redis-server` on a free port, so tests never touch a Redis the
developer uses, and fault tests may stop and restart it. Processes are started with this
interpreter, so the virtual environment that runs pytest is the one under test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("TOXFLEET_TEST_MODELS", ROOT / "models"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class RedisServer:
    """A private redis-server; `restart()` keeps the port (no persistence: a restart loses data)."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        wait_for(lambda: bool(client.ping()), 10, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: the tests run against a real Redis (apt-get install redis-server)")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(free_port(), Path(tmp))
        server.start()
        yield server
        server.stop()


@pytest.fixture(scope="session")
def tiny_checkpoint() -> tuple[Path, Path]:
    """The tiny synthetic checkpoint (`make test` builds it; built here if missing)."""
    ckpt = MODELS / "tiny" / "model.ckpt"
    if not ckpt.is_file():
        subprocess.run([sys.executable, "-m", "tools.synthetic", "tiny", "--out", str(MODELS)], check=True, cwd=ROOT)
    return ckpt, ckpt.parent / "hf"


@dataclass
class Proc:
    """A child process whose output goes to a log file the test can read."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def start(self) -> Proc:
        self._log = open(self.log, "ab")  # noqa: SIM115 - closed in stop(); the child writes to it meanwhile
        self.proc = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def base_env(redis_url: str, checkpoint: tuple[Path, Path] | None, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update({"REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    if checkpoint is not None:
        env.update({"TOXFLEET_CHECKPOINT": str(checkpoint[0]), "TOXFLEET_HF_CONFIG": str(checkpoint[1])})
    env.update(overrides)
    return env


def start_worker(tmp: Path, redis_url: str, checkpoint: tuple[Path, Path] | None, name: str = "w1",
                 concurrency: int = 2, wait: bool = True, env: dict[str, str] | None = None) -> Proc:
    """A real `celery -A worker worker` process; waits until its heartbeat says it is ready."""
    hostname = f"{name}-{os.getpid()}@test"
    proc = Proc(name, [sys.executable, "-m", "celery", "-A", "worker", "worker", "--loglevel=INFO", "--events",
                       "--hostname", hostname, "--concurrency", str(concurrency)],
                # Metrics off unless a test asks: several workers would contend for the default port.
                base_env(redis_url, checkpoint, **{"TOXFLEET_METRICS_PORT": "0", **(env or {})}),
                tmp / f"{name}.log")
    proc.extra["hostname"] = hostname
    proc.start()
    if wait:
        client = redis.Redis.from_url(redis_url)

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"worker exited:\n{proc.output()[-3000:]}")
            # Heartbeats start at worker_ready, after the pool processes loaded the model.
            beating = client.zscore("toxfleet:workers", hostname) is not None
            return beating and proc.output().count(" loaded ") >= concurrency

        wait_for(ready, 90, f"worker {hostname}", interval=0.2)
    return proc


def start_api(tmp: Path, redis_url: str, name: str = "api", **env: str) -> tuple[Proc, str]:
    """A real uvicorn serving api.main:app; returns the process and its base URL."""
    port = free_port()
    proc = Proc(name, [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(port),
                       "--no-access-log"], base_env(redis_url, None, **env), tmp / f"{name}.log").start()
    url = f"http://127.0.0.1:{port}"
    import httpx

    wait_for(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, 30, "uvicorn")
    return proc, url


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("procs")
