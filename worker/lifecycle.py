"""The worker's Celery signal wiring: check weights and backend before forking, load the model once
per pool process, then beat the heartbeat and run the sweeper; stop both at shutdown.

This module sits on top of the worker package: it imports the rest, and nothing imports it (Celery
loads it through the app's `include`). Nothing heavy happens at import: torch and Detoxify are
imported inside `worker_process_init`, in the pool process that will run the batches.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from celery import signals

from fleet import logs
from worker import state
from worker.gate.background import Regater
from worker.gate.decision import Decision
from worker.gate.selection import check, figures, why_chosen
from worker.heartbeat import HeartbeatThread
from worker.onnx_export.artifacts import ExportError
from worker.settings import get_settings
from worker.sweeper import Sweeper
from worker.tasks import score
from worker.weights import NO_WEIGHTS_HELP, check_weights

logger = logging.getLogger(__name__)

_loaded: Any = None  # multiprocessing.Value("i"): model loads completed by this worker's pool processes
_backend: dict[str, Any] = {"backend": None, "why": "", "gate": None}
"""What the main process says its pool processes run (they inherit its resolution, and follow its
switch): the backend, why (the gate's decision, or why `auto` runs the reference), and the gate
figures behind it when `auto` chose it; for the log and the heartbeat (`/readyz`)."""
_regater: Regater | None = None
_heartbeat: HeartbeatThread | None = None
_sweeper: Sweeper | None = None


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    global _loaded
    settings = get_settings()
    check_weights(settings)
    try:
        # Resolved once, here: the pool processes forked later inherit it (and the checkpoint's hash).
        state.resolved = check(settings)
    except ExportError as exc:
        raise SystemExit(f"toxfleet worker: TOXFLEET_BACKEND={settings.backend}: {exc}") from None
    decision = state.resolved.decision
    _backend.update(backend=state.resolved.name, why=state.resolved.why,
                    gate=figures(decision) if decision is not None else None)
    # Shared memory the pool processes (forked later) count their finished model loads into, and read
    # the backend to run from before each batch.
    _loaded = multiprocessing.Value("i", 0)
    state.switch = state.Switch(state.resolved.name)


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
    started = time.perf_counter()
    try:
        scorer = state.load(get_settings())
    except Exception as exc:
        # A pool process that cannot load the model would be replaced and fail again, forever:
        # stop the whole worker instead, with the reason on one line.
        logger.critical("toxfleet worker: cannot load the model: %r; %s", exc, NO_WEIGHTS_HELP)
        os.kill(os.getppid(), signal.SIGTERM)
        os._exit(1)
    if _loaded is not None:
        with _loaded.get_lock():
            _loaded.value += 1
    logger.info("pool process %d loaded %s (%s backend; a pass costs %d tokens beyond its own) in %.2fs",
                os.getpid(), scorer.backend.identity, scorer.backend.name, scorer.overhead,
                time.perf_counter() - started)


def _model_loads() -> int:
    """Model loads finished by this worker's pool processes (1 when none are counted: a worker
    started without `worker_init`, in tests)."""
    return int(_loaded.value) if _loaded is not None else 1


@signals.worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    global _heartbeat, _sweeper
    # Logged here, not at worker_init: Celery sets up logging after worker_init, and with text logs a
    # line logged before that is dropped.
    logger.info("backend %s (%s)", _backend["backend"], _backend["why"])
    settings = get_settings()
    _heartbeat = HeartbeatThread(settings, sender.hostname, sender.controller.concurrency,
                                 _backend["backend"] or settings.backend, _model_loads, _backend["gate"],
                                 status=_status)
    _heartbeat.start()
    _start_regater(settings, sender.hostname)
    if settings.sweep_seconds > 0:
        _sweeper = Sweeper(settings.redis_url, score.backend.get_key_for_task,
                           score.publish_again, settings.sweep_seconds, settings.result_expires)
        _sweeper.start()


def _start_regater(settings: Any, hostname: str) -> None:
    """With `auto` and no valid decision: get one (adopted from Redis, or gated) in the background."""
    global _regater
    resolved = state.resolved
    if (settings.backend != "auto" or resolved is None or resolved.decided or resolved.sha is None
            or resolved.directory is None):
        return
    if not settings.runtime_gate:
        logger.info("runtime gate off (TOXFLEET_RUNTIME_GATE=0): staying on %s", resolved.name)
        return
    _regater = Regater(settings, hostname, resolved.directory, resolved.sha, resolved.name, _switch_to,
                       serving=lambda: _model_loads() > 0)
    _regater.start()


def _switch_to(decision: Decision) -> None:
    """Point the pool processes at the decision's backend: each loads it before its next batch."""
    why = f"runtime gate: {why_chosen(decision)}"
    _backend.update(backend=decision.chosen, why=why, gate=figures(decision))
    if state.switch is not None:
        generation = state.switch.set(decision.chosen)
        logger.info("backend %s (%s); pool processes switch before their next batch (generation %d)",
                    decision.chosen, why, generation)


def _status() -> dict[str, Any]:
    """What the heartbeat says may change: the backend, why, its gate figures, the runtime gate's state."""
    regater = _regater
    return {**_backend, "gating": regater.status() if regater is not None else None}


@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    if _regater is not None:
        _regater.stop()
    if _sweeper is not None:
        _sweeper.stop()
    if _heartbeat is not None:
        _heartbeat.stop()
