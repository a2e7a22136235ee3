"""The runtime gate: a worker whose `auto` found no valid decision for its kind of CPU gets one by itself.

A thread in the worker's main process, started once the worker serves (with the reference):

1. A decision another worker published in Redis for the same decision key (`worker.gate.shared`) is
   adopted: written to the local `decision.json` (a restart resolves it at once) and handed to
   `on_decision`, which switches the pool processes between batches.
2. Otherwise one worker per decision key takes a lock in Redis and runs the gate,
   `python -m worker.gate --decision-file F` (the export included, if missing), as a subprocess at the
   lowest CPU priority (`TOXFLEET_GATE_NICE`, 19) with the worker's threads per process, relaying its
   progress lines to the log and to Redis. On success it publishes the decision (the first one
   published stands) and adopts it.
   The others wait for it, reading the holder's progress.
3. A gate that fails, exceeds `TOXFLEET_GATE_TIMEOUT` (killed) or crashes leaves the worker on what it
   runs; the failure is recorded in Redis so the whole fleet waits `TOXFLEET_GATE_RETRY_SECONDS`,
   doubled per further failure up to `TOXFLEET_GATE_RETRY_MAX_SECONDS`, before anyone gates again.
4. With Redis away the worker keeps its backend and retries later; a gate already running finishes and
   its decision is adopted locally.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from fleet import redis_url as urls
from worker.gate import shared
from worker.gate.decision import Decision
from worker.gate.selection import decision_at, verify_for
from worker.onnx_export.artifacts import ExportError
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

POLL_SECONDS = 5.0
"""How often a worker waiting on another's gate looks for its decision (and its progress)."""

LOCK_SECONDS = 60.0
"""Lifetime of the gate lock; its holder renews it every third of this, so a holder that dies frees
the kind of CPU for another worker within this."""

OUTPUT_LINES = 20
"""Last lines of a failed gate's output kept for its reason."""

STOP_SECONDS = 5.0
"""Grace a gate subprocess gets after SIGTERM (the worker stopping, a timeout) before SIGKILL."""


class GateRun:
    """One subprocess at low priority, its output relayed line by line to the log."""

    def __init__(self, argv: list[str], env: dict[str, str], label: str, niceness: int) -> None:
        nice = shutil.which("nice")
        self.proc = subprocess.Popen(([nice, "-n", str(niceness)] if nice else []) + argv, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace")
        if nice is None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, niceness)
        self.label = label
        self.tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.last = ""
        self._reader = threading.Thread(target=self._relay, name="toxfleet-gate-output", daemon=True)
        self._reader.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip()
            if not line:
                continue
            self.tail.append(line)
            self.last = line
            logger.info("runtime %s [pid %d]: %s", self.label, self.proc.pid, line)

    def kill(self) -> None:
        """SIGTERM, SIGKILL after `STOP_SECONDS`. It stays in the worker's process group, so that
        whatever stops the whole worker (a container's end, a test's group kill) stops it too."""
        for sig, grace in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGKILL, STOP_SECONDS)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue

    def outcome(self) -> str | None:
        """None if it exited 0, else why it failed (exit status and its last lines)."""
        self._reader.join(5)
        code = self.proc.returncode
        if code == 0:
            return None
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"{self.label} {how}: " + " | ".join(list(self.tail)[-5:])


class Regater(threading.Thread):
    """Gets this worker a valid decision (adopted or gated) and hands it to `on_decision`, then ends."""

    def __init__(self, settings: WorkerSettings, hostname: str, directory: Path, sha: str, current: str,
                 on_decision: Callable[[Decision], None], serving: Callable[[], bool] = lambda: True) -> None:
        super().__init__(name="toxfleet-runtime-gate", daemon=True)
        self._settings = settings
        self._client = urls.sync_client(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._hostname = hostname
        self._directory = directory
        self._sha = sha
        self._current = current
        self._on_decision = on_decision
        self._serving = serving
        """True once a pool process has loaded its model: the gate waits for that, so that it never slows
        the worker's own start."""
        self.digest = shared.decision_key(sha)
        self._token = f"{hostname}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._status: dict[str, Any] = {"state": "starting", "key": self.digest[:12]}
        self._status_lock = threading.Lock()
        self._local_failures = 0
        # Not `_stop`: threading.Thread has a `_stop()` method.
        self._stopping = threading.Event()
        self._run: GateRun | None = None
        self._decision_file = Path(tempfile.gettempdir()) / f"toxfleet-gate-{os.getpid()}-{self.digest[:12]}.json"
        """Where the gate subprocess writes its decision."""

    # -- what the heartbeat shows -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._status_lock:
            status = dict(self._status)
        run = self._run
        if run is not None and status.get("state") == "gating":
            status["progress"] = run.last[:200]
        return status

    def _set(self, **fields: Any) -> None:
        with self._status_lock:
            self._status = {"key": self.digest[:12], **fields}

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        logger.info("runtime gate: no valid decision for this checkpoint on this CPU (key %s); serving with %s "
                    "while the fleet decides", self.digest[:12], self._current)
        while not self._serving():
            if self._stopping.wait(0.5):
                return
        delay = 0.0
        redis_down = False
        while not self._stopping.wait(delay):
            try:
                next_delay = self._step()
                redis_down = False
            except RedisError as exc:
                if not redis_down:
                    logger.warning("runtime gate: Redis unavailable (%r); keeping %s, trying again", exc,
                                   self._current)
                redis_down = True
                self._set(state="unavailable", last_error=f"Redis: {exc!r}"[:300])
                next_delay = 2 * POLL_SECONDS
            except Exception as exc:  # a bug here must never stop the worker: keep serving, try later
                logger.exception("runtime gate: unexpected error; keeping %s", self._current)
                next_delay = self._backoff_local(f"unexpected error: {exc!r}")
            if next_delay is None:
                return
            delay = next_delay

    def stop(self) -> None:
        self._stopping.set()
        run = self._run
        if run is not None and run.proc.poll() is None:
            run.kill()

    def _step(self) -> float | None:
        """One look at the fleet's records; the seconds to wait before the next, None when decided."""
        client, digest = self._client, self.digest
        decision = shared.read_decision(client, digest, self._sha)
        if decision is not None:
            return self._adopt(decision, "published in Redis")
        failed = shared.failure(client, digest)
        now = time.time()
        if failed is not None and failed["retry_at"] > now:
            self._set(state="backoff", attempts=failed["attempts"], retry_at=failed["retry_at"],
                      last_error=failed["reason"][:300])
            return min(float(failed["retry_at"]) - now, POLL_SECONDS)
        if shared.take_lock(client, digest, self._token, int(LOCK_SECONDS * 1000)):
            return self._gate(failed["attempts"] if failed is not None else 0)
        self._set(state="waiting", holder=shared.lock_holder(client, digest),
                  progress=(shared.progress(client, digest) or "")[:200])
        return POLL_SECONDS

    def _backoff_local(self, reason: str) -> float:
        """This worker's own wait after a failure that Redis cannot record (or that is this worker's)."""
        self._local_failures += 1
        wait = self._retry_wait(self._local_failures)
        self._set(state="backoff", attempts=self._local_failures, retry_at=time.time() + wait, last_error=reason[:300])
        return wait

    def _retry_wait(self, attempts: int) -> float:
        settings = self._settings
        return float(min(settings.gate_retry_seconds * 2 ** max(0, attempts - 1), settings.gate_retry_max_seconds))

    # -- gating -------------------------------------------------------------------------------------

    def _gate(self, attempts: int) -> float | None:
        """Run the gate holding the lock; adopt its decision, or record the failure for the fleet."""
        client, digest = self._client, self.digest
        started = time.time()
        try:
            shared.record_run(client, digest, self._hostname, os.getpid())
            outcome = self._run_gate(attempts)
        finally:
            with contextlib.suppress(RedisError):
                shared.release_lock(client, digest, self._token)
            self._run = None
        if outcome == "lost":
            return POLL_SECONDS
        if outcome is None:
            decision = self._gated()
            if isinstance(decision, str):
                outcome = f"the gate exited 0 but left no valid decision ({decision})"
            else:
                return self._publish(decision, time.time() - started)
        attempts += 1
        wait = self._retry_wait(attempts)
        logger.error("runtime gate failed (attempt %d, %.0f s): %s; this worker keeps %s; the fleet tries again "
                     "in %.0f s", attempts, time.time() - started, outcome, self._current, wait)
        try:
            shared.record_failure(client, digest, attempts, time.time() + wait, outcome,
                                  wait + self._settings.gate_retry_max_seconds)
        except RedisError as exc:
            logger.warning("runtime gate: could not record the failure in Redis (%r)", exc)
        self._set(state="backoff", attempts=attempts, retry_at=time.time() + wait, last_error=outcome[:300])
        return wait

    def _gated(self) -> Decision | str:
        """The decision the gate subprocess just wrote, if it holds here; else why not."""
        try:
            decision = Decision.read_file(self._decision_file)
        except (OSError, ValueError, TypeError) as exc:
            return f"{self._decision_file}: {exc!r}"
        reason = decision.invalid_because(self._sha)
        return decision if reason is None else reason

    def _publish(self, decision: Decision, seconds: float) -> float | None:
        """Share this gate's decision (the first one published stands) and adopt what stands."""
        logger.info("runtime gate decided %s in %.0f s", decision.chosen, seconds)
        try:
            if not shared.publish_decision(self._client, self.digest, decision):
                standing = shared.read_decision(self._client, self.digest, self._sha)
                if standing is not None:
                    logger.info("runtime gate: another worker published %s first; adopting that", standing.chosen)
                    decision = standing
            shared.clear_failure(self._client, self.digest)
        except RedisError as exc:  # the decision stands locally; others will gate or find it later
            logger.warning("runtime gate: could not publish the decision to Redis (%r); adopting it here", exc)
        return self._adopt(decision, "gated by this worker")

    def _env(self) -> dict[str, str]:
        threads = str(self._settings.torch_threads)
        return {**os.environ, "TOXFLEET_TORCH_THREADS": threads, "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads}

    def _gate_argv(self) -> list[str]:
        # Written to a file of its own, not the export directory, which may be read-only (the image's).
        argv = [sys.executable, "-m", "worker.gate", "--decision-file", str(self._decision_file)]
        if self._settings.gate_texts is not None:
            argv += ["--texts", str(self._settings.gate_texts)]
        if self._settings.gate_backends is not None:
            argv += ["--backends", self._settings.gate_backends]
        return argv

    def _run_gate(self, failed_before: int) -> str | None:
        """Run the gate subprocess to its end, renewing the lock: None on success, "lost" if another
        worker holds the lock now (this gate was stopped), else why it failed. `failed_before`: the
        fleet's failed gates for this key so far (shown in the heartbeat)."""
        client, digest = self._client, self.digest
        deadline = time.monotonic() + self._settings.gate_timeout
        self._decision_file.unlink(missing_ok=True)
        run = self._run = GateRun(self._gate_argv(), self._env(), "gate", self._settings.gate_nice)
        logger.info("runtime gate: started for key %s as pid %d (nice %d, %d thread(s)): %s", digest[:12],
                    run.proc.pid, self._settings.gate_nice, self._settings.torch_threads,
                    " ".join(self._gate_argv()[1:]))
        self._set(state="gating", holder=self._token, pid=run.proc.pid, since=time.time(), attempts=failed_before)
        renew_every = min(LOCK_SECONDS / 3, POLL_SECONDS)  # also how fresh the progress others read is
        renewed = time.monotonic()
        while run.proc.poll() is None:
            if self._stopping.wait(1.0):
                run.kill()
                return "the worker is stopping"
            if time.monotonic() > deadline:
                run.kill()
                return f"gate timed out after {self._settings.gate_timeout:.0f} s (TOXFLEET_GATE_TIMEOUT): killed"
            if time.monotonic() - renewed >= renew_every:
                try:
                    held = (shared.renew_lock(client, digest, self._token, int(LOCK_SECONDS * 1000))
                            or shared.take_lock(client, digest, self._token, int(LOCK_SECONDS * 1000)))
                    if not held:
                        holder = shared.lock_holder(client, digest)
                        logger.warning("runtime gate: lost the gate lock to %s; stopping this gate and waiting "
                                       "for theirs", holder)
                        run.kill()
                        return "lost"
                    shared.set_progress(client, digest, run.last, int(LOCK_SECONDS * 1000))
                except RedisError as exc:  # keep gating: the result is adopted locally at least
                    logger.warning("runtime gate: cannot renew the lock (%r); gating on", exc)
                renewed = time.monotonic()
        return run.outcome()

    # -- adopting -----------------------------------------------------------------------------------

    def _adopt(self, decision: Decision, source: str) -> float | None:
        """Make `decision` this worker's: its export checked (built here, at low priority, if missing),
        written to the local decision.json, handed to `on_decision`. None when done, else a wait."""
        try:
            verify_for(decision.chosen, self._settings)
        except ExportError as exc:
            logger.info("runtime gate: %s needs this checkpoint's export here (%s); building it", decision.chosen, exc)
            self._set(state="exporting", chosen=decision.chosen)
            # Adopting needs the artifacts only: no gate, and no reference scores (only a gate reads them).
            run = self._run = GateRun([sys.executable, "-m", "worker.export", "--no-gate", "--no-reference"],
                                      self._env(), "export", self._settings.gate_nice)
            try:
                while run.proc.poll() is None:
                    if self._stopping.wait(1.0):
                        run.kill()
                        return None
                failed = run.outcome()
            finally:
                self._run = None
            try:
                verify_for(decision.chosen, self._settings)
            except ExportError as again:
                reason = failed or str(again)
                wait = self._backoff_local(f"export for {decision.chosen}: {reason}")
                logger.error("runtime gate: cannot use %s here (%s); keeping %s, trying again in %.0f s",
                             decision.chosen, reason, self._current, wait)
                return wait
        if isinstance(decision_at(self._directory, self._sha), str):
            try:
                self._directory.mkdir(parents=True, exist_ok=True)
                decision.write(self._directory)
            except OSError as exc:  # a read-only image: Redis still has it for the next start
                logger.warning("runtime gate: cannot write %s (%r)", self._directory, exc)
        self._on_decision(decision)
        self._set(state="decided", chosen=decision.chosen, source=source)
        return None
