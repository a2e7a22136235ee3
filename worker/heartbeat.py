"""The worker's heartbeat: keeps `toxfleet:workers` (a sorted set of hostnames by last beat) and a
per-worker info key fresh, for the API's `/readyz` and fleet view.

It starts beating only once a pool process has loaded the model, so `/readyz` never counts a worker
that cannot score yet (Celery itself answers pings before that). The key names and the JSON of the
info key are read by the API: they must not change.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis

from toxfleet import contract
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
"""How often a worker refreshes its entry in the worker registry the API reads for /readyz."""


class Heartbeat(threading.Thread):
    """Beats every HEARTBEAT_SECONDS once `model_loads()` (pool processes that loaded the model) is
    above zero, and removes the worker's entry on `stop()`."""

    def __init__(self, settings: WorkerSettings, hostname: str, concurrency: int, backend: str,
                 model_loads: Callable[[], int]) -> None:
        super().__init__(name="toxfleet-heartbeat", daemon=True)
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._hostname = hostname
        self._model_loads = model_loads
        self._info = {"hostname": hostname, "model": settings.model_identity,
                      "backend": backend, "cache": settings.cache,
                      "concurrency": concurrency,
                      "pid": os.getpid(), "host": socket.gethostname()}
        # Not `_stop`: threading.Thread has a `_stop()` method that fork calls on every thread.
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            loads = self._model_loads()
            if loads:
                info = json.dumps({**self._info, "model_loads": loads})
                try:
                    with self._redis.pipeline(transaction=False) as pipe:
                        pipe.zadd(contract.WORKERS_KEY, {self._hostname: time.time()})
                        pipe.set(contract.WORKER_INFO_PREFIX + self._hostname, info, ex=int(HEARTBEAT_SECONDS * 3))
                        pipe.execute()
                except Exception as exc:  # Redis away: keep trying, the API will call us absent
                    logger.debug("heartbeat failed: %r", exc)
            # Beat soon after the first model load, then every HEARTBEAT_SECONDS.
            self._stopping.wait(HEARTBEAT_SECONDS if loads else 0.2)

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._redis.zrem(contract.WORKERS_KEY, self._hostname)
            self._redis.delete(contract.WORKER_INFO_PREFIX + self._hostname)
        except Exception:
            pass
