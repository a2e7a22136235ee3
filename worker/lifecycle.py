"""Worker lifecycle hooks: check weights before forking, load the model once per pool process,
announce the worker to the API.

Nothing heavy happens at import: torch and Detoxify are imported inside `worker_process_init`, in
the pool process that will run the batches (celery-batches measured: that is where batches run).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import signals

from toxfleet import contract, logs
from worker.settings import WorkerSettings, get_settings
from worker.sweeper import Sweeper

if TYPE_CHECKING:
    from worker.scorer import Scorer

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
"""How often a worker refreshes its entry in the worker registry the API reads for /readyz."""

DETOXIFY_URLS = {
    "original": "https://github.com/unitaryai/detoxify/releases/download/v0.1-alpha/toxic_original-c1212f89.ckpt",
    "unbiased": "https://github.com/unitaryai/detoxify/releases/download/v0.3-alpha/toxic_debiased-c7548aa0.ckpt",
    "multilingual": "https://github.com/unitaryai/detoxify/releases/download/v0.4-alpha/multilingual_debiased-0b549669.ckpt",
    "original-small": "https://github.com/unitaryai/detoxify/releases/download/v0.1.2/original-albert-0e1d6498.ckpt",
    "unbiased-small": "https://github.com/unitaryai/detoxify/releases/download/v0.1.2/unbiased-albert-c8519128.ckpt",
}
"""Detoxify's own weight URLs (copied so the main process need not import torch; a test keeps them equal)."""

NO_WEIGHTS_HELP = (
    "provide a Detoxify checkpoint with TOXFLEET_CHECKPOINT=<file.ckpt> and TOXFLEET_HF_CONFIG=<dir> "
    "(`python -m worker.synthetic tiny` builds an offline stand-in), or run where "
    "github.com and huggingface.co are reachable so Detoxify can download TOXFLEET_MODEL"
)

_scorer: Scorer | None = None
_loaded: Any = None  # multiprocessing.Value("i"): model loads completed by this worker's pool processes
_backend_name: str | None = None
"""The backend `auto` resolved to in the main process, for the heartbeat (pool processes resolve alike)."""
_backend_why = ""
"""Why that backend (the gate's decision, or why `auto` runs the reference), logged once the worker is ready."""


def scorer() -> Scorer:
    """This process's scorer, loaded at pool-process init (or on first use when run eagerly)."""
    global _scorer
    if _scorer is None:
        _scorer = _load(get_settings())
    return _scorer


def _load(settings: WorkerSettings) -> Scorer:
    from worker.backend import load_backend
    from worker.scorer import Scorer

    return Scorer(load_backend(settings), settings.pass_tokens, settings.pass_texts)


def _torch_hub_checkpoint(url: str) -> Path:
    torch_home = os.environ.get("TORCH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torch")
    return Path(torch_home) / "hub" / "checkpoints" / url.rsplit("/", 1)[1]


def check_weights(settings: WorkerSettings) -> None:
    """Exit with one clear line when no weights can be had, rather than fork processes that fail."""
    if settings.checkpoint is not None:
        return  # existence was checked by the settings
    url = DETOXIFY_URLS.get(settings.model)
    if url is None:
        raise SystemExit(f"toxfleet worker: unknown TOXFLEET_MODEL={settings.model!r} "
                         f"(known: {', '.join(DETOXIFY_URLS)})")
    target = _torch_hub_checkpoint(url)
    if target.is_file():
        return
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SystemExit(f"toxfleet worker: no weights for {settings.model!r} in {target.parent} and "
                         f"HF_HUB_OFFLINE=1; {NO_WEIGHTS_HELP}")
    import urllib.request

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    try:
        logger.info("downloading %s weights from %s", settings.model, url)
        with urllib.request.urlopen(url, timeout=30) as response, open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        partial.rename(target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"toxfleet worker: cannot download {settings.model!r} weights ({exc}); "
                         f"{NO_WEIGHTS_HELP}") from None


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    from worker.tasks import score

    global _loaded, _backend_name, _backend_why
    settings = get_settings()
    check_weights(settings)
    from worker.export import ExportError
    from worker.selection import check_backend

    try:
        _backend_name, _backend_why = check_backend(settings)
    except ExportError as exc:
        raise SystemExit(f"toxfleet worker: TOXFLEET_BACKEND={settings.backend}: {exc}") from None
    # Shared memory the pool processes (forked later) count their finished model loads into.
    _loaded = multiprocessing.Value("i", 0)
    score.batch_tokens = settings.batch_tokens
    score.max_retries = settings.max_retries


@signals.celeryd_init.connect
def _on_celeryd_init(instance: Any = None, **_: Any) -> None:
    if get_settings().log_format == "json" and instance is not None:
        # Every line JSON: no start-up banner, and warnings (such as Celery's about running as root,
        # issued before Celery sets up logging) go through logging, in JSON, too.
        instance.quiet = True
        logs.configure("json")
        logging.captureWarnings(True)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _on_setup_logger(logger: logging.Logger | None = None, **_: Any) -> None:
    # Celery configured its handlers (pool processes inherit them): switch them to JSON lines.
    if get_settings().log_format == "json" and logger is not None:
        logs.use_json([logger.name])


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    global _scorer
    started = time.perf_counter()
    try:
        _scorer = _load(get_settings())
    except Exception as exc:
        # A pool process that cannot load the model would be replaced and fail again, forever:
        # stop the whole worker instead, with the reason on one line.
        logger.critical("toxfleet worker: cannot load the model: %r; %s", exc, NO_WEIGHTS_HELP)
        os.kill(os.getppid(), signal.SIGTERM)
        os._exit(1)
    if _loaded is not None:
        with _loaded.get_lock():
            _loaded.value += 1
    logger.info("pool process %d loaded %s (%s backend) in %.2fs", os.getpid(), _scorer.backend.identity,
                _scorer.backend.name, time.perf_counter() - started)


class _Heartbeat(threading.Thread):
    """Keeps `toxfleet:workers` (a sorted set of hostnames by last beat) and a per-worker info key fresh.

    It starts beating only once a pool process has loaded the model, so `/readyz` never counts a
    worker that cannot score yet (Celery itself answers pings before that)."""

    def __init__(self, hostname: str, concurrency: int) -> None:
        super().__init__(name="toxfleet-heartbeat", daemon=True)
        import redis

        settings = get_settings()
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._hostname = hostname
        self._info = {"hostname": hostname, "model": settings.model_identity,
                      "backend": _backend_name or settings.backend, "cache": settings.cache,
                      "concurrency": concurrency,
                      "pid": os.getpid(), "host": socket.gethostname()}
        # Not `_stop`: threading.Thread has a `_stop()` method that fork calls on every thread.
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            loads = _loaded.value if _loaded is not None else 1
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


_heartbeat: _Heartbeat | None = None
_sweeper: Sweeper | None = None


@signals.worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    global _heartbeat, _sweeper
    from worker.tasks import score

    # Logged here, not at worker_init: Celery sets up logging after worker_init, and with text logs a
    # line logged before that is dropped.
    logger.info("backend %s (%s)", _backend_name, _backend_why)
    _heartbeat = _Heartbeat(sender.hostname, sender.controller.concurrency)
    _heartbeat.start()
    settings = get_settings()
    if settings.sweep_seconds > 0:
        _sweeper = Sweeper(settings.redis_url, score.backend.get_key_for_task,
                           score.publish_again, settings.sweep_seconds, settings.result_expires)
        _sweeper.start()


@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    if _sweeper is not None:
        _sweeper.stop()
    if _heartbeat is not None:
        _heartbeat.stop()
