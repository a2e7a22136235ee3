"""Child processes with their output in a log file, free ports, and waiting for a condition."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: children start there, so `-m worker`, `-m api.main` and `-m bench` resolve."""


_GROUPS: set[int] = set()
"""Process groups this process started (each child in a session of its own, so a Ctrl-C at the
terminal reaches only the test runner) and has not stopped yet."""


def track(pid: int) -> None:
    """Note a child started in its own session; `untrack` it once stopped."""
    _GROUPS.add(pid)


def untrack(pid: int) -> None:
    _GROUPS.discard(pid)


def reap_on_term() -> None:
    """On SIGTERM, kill every tracked group, then go on as after a Ctrl-C (KeyboardInterrupt: pytest
    tears its fixtures down). CI's overall `timeout` sends SIGTERM to its process group only; children
    in sessions of their own would otherwise outlive the run, as daemons holding ports and CPU."""
    def reap(signum: int, frame: object) -> None:
        for pgid in list(_GROUPS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            _GROUPS.discard(pgid)
        raise KeyboardInterrupt(f"signal {signum}: every child process group killed")

    signal.signal(signal.SIGTERM, reap)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class GaveUp(Exception):
    """Raised by a `wait_for` predicate when waiting longer cannot help (the process waited on exited);
    it ends the wait at once, with the predicate's message, where any other error means "not yet"."""


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except GaveUp:
            raise
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _stats() -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live process."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            out.append((int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()))
        except OSError:
            continue
    return out


def child_pids(parent: int) -> list[int]:
    """Pids of a process's direct children (a Celery worker's pool processes), read from /proc."""
    return [pid for pid, fields in _stats() if int(fields[1]) == parent]


def group_members(pgid: int) -> list[int]:
    """Pids of the processes, zombies aside, in process group `pgid`."""
    return [pid for pid, fields in _stats() if int(fields[2]) == pgid and fields[0] != "Z"]


@dataclass
class Proc:
    """A child process whose output goes to a log file the test can read."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, str] = field(default_factory=dict)
    own_session: bool = True
    """Start it in a session of its own (its process group is killed with it). False keeps it in this
    process's session, and so in its scheduler autogroup: what nice values are relative to."""

    def start(self) -> Proc:
        self._log = open(self.log, "ab")  # noqa: SIM115 - closed in stop(); the child writes to it meanwhile
        self.proc = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=self.own_session)
        track(self.proc.pid)
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
        # Whatever is left of its group (a killed worker's pool processes) goes with it.
        if self.own_session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        untrack(self.proc.pid)
        self._log.close()
        return self.proc.returncode


def base_env(redis_url: str, checkpoint: tuple[Path, Path] | None, **overrides: str) -> dict[str, str]:
    """This environment without any TOXFLEET_ setting of the developer's, pointed at `redis_url`. The
    runtime gate is off unless `overrides` turn it on: a worker on the tiny checkpoint without a decision
    would otherwise gate every candidate in the background and change backend in the middle of a test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    # The server packages run from the checkout, not from site-packages: console scripts (celery,
    # uvicorn) find them through PYTHONPATH, wherever they are started.
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update({"REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path,
                "TOXFLEET_RUNTIME_GATE": "0"})
    if checkpoint is not None:
        env.update({"TOXFLEET_CHECKPOINT": str(checkpoint[0]), "TOXFLEET_HF_CONFIG": str(checkpoint[1])})
    env.update(overrides)
    return env
