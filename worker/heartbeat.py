"""The worker's heartbeat: keeps `toxfleet:workers` (a sorted set of hostnames by last beat) and a
per-worker info key fresh, for the API's `/readyz` and fleet view.

It starts beating only once a pool process has loaded the model, so `/readyz` never counts a worker
that cannot score yet (Celery itself answers pings before that). The key names and the JSON of the
info key are read by the API: they must not change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fleet import redis_url as urls
from fleet.keys import HEARTBEAT_SECONDS, Heartbeat
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


class HeartbeatThread(threading.Thread):
    """Beats every HEARTBEAT_SECONDS once `model_loads()` (pool processes that loaded the model) is
    above zero, and removes the worker's entry on `stop()`. What a beat says is `fleet.keys.Heartbeat`."""

    def __init__(self, settings: WorkerSettings, hostname: str, concurrency: int, backend: str,
                 model_loads: Callable[[], int], gate: dict[str, Any] | None = None,
                 status: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__(name="toxfleet-heartbeat", daemon=True)
        self._redis = urls.sync_client(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._model_loads = model_loads
        self._status = status
        """What may change while the worker runs (backend, why, gate, gating), read at every beat."""
        self._beat = Heartbeat(hostname, model=settings.model_identity, backend=backend,
                               configured=settings.backend, cache=settings.cache,
                               concurrency=concurrency, pid=os.getpid(), host=socket.gethostname(), gate=gate)
        # Not `_stop`: threading.Thread has a `_stop()` method that fork calls on every thread.
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            loads = self._model_loads()
            if loads:
                try:
                    with self._redis.pipeline(transaction=False) as pipe:
                        changing = self._status() if self._status is not None else {}
                        dataclasses.replace(self._beat, model_loads=loads, **changing).write(pipe, time.time())
                        pipe.execute()
                except Exception as exc:  # Redis away: keep trying, the API will call us absent
                    logger.debug("heartbeat failed: %r", exc)
            # Beat soon after the first model load, then every HEARTBEAT_SECONDS.
            self._stopping.wait(HEARTBEAT_SECONDS if loads else 0.2)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(Exception):  # Redis away: the entry goes stale by itself
            Heartbeat.clear(self._redis, self._beat.hostname)
