"""The service processes, started for real: a Celery worker, the API under uvicorn, Flower, or all three."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api import UVICORN_OPTIONS
from fleet import keys
from fleet import redis_url as urls
from testing.processes import GaveUp, Proc, base_env, free_port, wait_for
from testing.redis_server import RedisServer


def execution_log(tmp: Path) -> Path:
    """The file in which the workers started under `tmp` record each batch's claimed requests before
    scoring (`TOXFLEET_EXECUTION_LOG`, worker/executions.py); `testing.faults.ExecutionLog` reads it."""
    return tmp / "executions.jsonl"


def start_worker(tmp: Path, redis_url: str, checkpoint: tuple[Path, Path] | None, name: str = "w1",
                 concurrency: int = 2, wait: bool = True, env: dict[str, str] | None = None,
                 own_session: bool = True) -> Proc:
    """A real `celery -A worker worker` process; waits until its heartbeat says it is ready."""
    hostname = f"{name}-{os.getpid()}@test"
    proc = Proc(name, [sys.executable, "-m", "celery", "-A", "worker", "worker", "--loglevel=INFO", "--events",
                       "--hostname", hostname, "--concurrency", str(concurrency)],
                # Metrics off unless a test asks: several workers would contend for the default port.
                base_env(redis_url, checkpoint, **{"TOXFLEET_METRICS_PORT": "0",
                                                   "TOXFLEET_EXECUTION_LOG": str(execution_log(tmp)), **(env or {})}),
                tmp / f"{name}.log", own_session=own_session)
    proc.extra["hostname"] = hostname
    proc.start()
    if wait:
        client = urls.sync_client(redis_url)

        def ready() -> bool:
            if not proc.alive():
                raise GaveUp(f"worker exited:\n{proc.output()[-3000:]}")
            # Heartbeats start at worker_ready, after the pool processes loaded the model.
            beating = client.zscore(keys.WORKERS_KEY, hostname) is not None
            return beating and proc.output().count(" loaded ") >= concurrency

        wait_for(ready, 90, f"worker {hostname}", interval=0.2)
    return proc


def start_api(tmp: Path, redis_url: str, name: str = "api", access_log: bool = False,
              **env: str) -> tuple[Proc, str]:
    """A real uvicorn serving api.main:app; returns the process and its base URL. Its Prometheus
    endpoint listens on a free port of its own (not the default, which may be taken on a shared
    machine) unless `env` sets TOXFLEET_API_METRICS_PORT; `api_metrics(proc)` is its URL."""
    port = free_port()
    env = {"TOXFLEET_API_METRICS_PORT": str(free_port()), **env}
    argv = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(port),
            *UVICORN_OPTIONS, *([] if access_log else ["--no-access-log"])]
    proc = Proc(name, argv, base_env(redis_url, None, **env), tmp / f"{name}.log")
    proc.extra["metrics"] = f"http://127.0.0.1:{env['TOXFLEET_API_METRICS_PORT']}/metrics"
    proc.start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, 30, "uvicorn")
    return proc, url


def api_metrics(api: Proc) -> str:
    """The URL of the Prometheus endpoint of an API `start_api` started."""
    return api.extra["metrics"]


def start_flower(tmp: Path, env: dict[str, str], auth: tuple[str, str], name: str = "flower") -> tuple[Proc, str]:
    """Real Flower (`celery -A worker flower`) behind basic auth; returns the process and its base URL."""
    port = free_port()
    proc = Proc(name, [sys.executable, "-m", "celery", "-A", "worker", "flower", "--address=127.0.0.1",
                       f"--port={port}"], {**env, "FLOWER_BASIC_AUTH": ":".join(auth)}, tmp / f"{name}.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/healthcheck", timeout=1).status_code == 200, 30, "flower")
    return proc, url


@dataclass(frozen=True)
class FleetSpec:
    """What a test module's fleet differs in: process names, a Redis database, extra settings, Flower."""

    name: str
    db: int = 0
    worker_env: dict[str, str] = field(default_factory=dict)
    api_env: dict[str, str] = field(default_factory=dict)
    flower_auth: tuple[str, str] | None = None
    access_log: bool = False


@dataclass
class Fleet:
    """A running fleet: one worker (metrics on a port of its own), the API and optionally Flower."""

    redis: RedisServer
    redis_url: str
    url: str
    worker: Proc
    api: Proc
    worker_metrics: str
    flower_url: str | None
    procs: list[Proc]

    @property
    def api_metrics(self) -> str:
        """The API's Prometheus endpoint (its own port; the API's port serves no /metrics)."""
        return api_metrics(self.api)

    @property
    def flower(self) -> str:
        assert self.flower_url is not None, "this fleet runs no Flower (FleetSpec.flower_auth)"
        return self.flower_url

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def start_fleet(tmp: Path, server: RedisServer, checkpoint: tuple[Path, Path], spec: FleetSpec) -> Fleet:
    """A worker on `checkpoint`, the API and (with `spec.flower_auth`) Flower, on an emptied database."""
    redis_url = server.flush(spec.db)
    metrics_port = free_port()
    procs = [start_worker(tmp, redis_url, checkpoint, name=spec.name,
                          env={"TOXFLEET_METRICS_PORT": str(metrics_port), **spec.worker_env})]
    try:
        api, url = start_api(tmp, redis_url, name=f"{spec.name}-api", access_log=spec.access_log,
                             **spec.api_env)
        procs.append(api)
        flower_url = None
        if spec.flower_auth is not None:
            flower, flower_url = start_flower(tmp, procs[0].env, spec.flower_auth, name=f"{spec.name}-flower")
            procs.append(flower)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_for(lambda: httpx.get(metrics, timeout=1).status_code == 200, 20, "worker metrics")
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise
    return Fleet(server, redis_url, url, procs[0], api, metrics, flower_url, procs)
