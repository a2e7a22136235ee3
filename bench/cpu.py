"""CPU time, read from /proc: of the service under test, of the load generator, of the whole machine.

The service's share (its process tree, Redis included for toxfleet) says how much of the cores it
kept busy; the machine's total minus service and load generator is what *other* programs used
meanwhile, so a run disturbed by a neighbour shows it instead of passing for a slow service.
Linux only: the harness measures the deployment target, which is Linux.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; everything after its closing parenthesis splits cleanly.
    return raw[raw.rindex(")") + 2:].split()


def _parents() -> dict[int, int]:
    """pid -> parent pid for every process now alive."""
    out: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                out[int(entry.name)] = int(fields[1])
    return out


def process_tree(roots: Iterable[int]) -> set[int]:
    """The roots and all their descendants now alive."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = [r for r in roots if r in parents]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    return found


def process_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the command name: state is index 0, utime index 11, stime index 12 (fields 14 and 15 of stat(5)).
    return (int(fields[11]) + int(fields[12])) / _TICKS


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (from /proc/stat)."""
    first = (_PROC / "stat").read_text().splitlines()[0].split()
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    # guest time is already counted in user; count the first eight fields only.
    return (sum(values[:8]) - idle) / _TICKS


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    service: dict[int, float]
    client: float
    machine: float
    roles: dict[int, str] = field(default_factory=dict)
    """pid -> the part of the service it is (e.g. api, worker main, pool, redis)."""


@dataclass(frozen=True)
class CpuUse:
    """Average cores used over an interval."""

    service: float
    client: float
    other: float
    machine: float
    roles: dict[str, float] = field(default_factory=dict)
    """Cores used by each part of the service (see `CpuMeter`)."""

    def as_dict(self) -> dict[str, Any]:
        return {"service": self.service, "client": self.client, "other": self.other, "machine": self.machine,
                "roles": self.roles}


class CpuMeter:
    """Snapshots of CPU time; `between(a, b)` turns two into cores used."""

    def __init__(self, service_roots: Iterable[int], roles: Mapping[int, tuple[str, str]] | None = None) -> None:
        """`roles`: root pid -> (its own role, its descendants' role), e.g. the Celery worker's
        main process -> ("worker main", "pool"); CPU is then also reported per role."""
        self.roots = list(service_roots)
        self.role_roots = dict(roles or {})

    def snapshot(self) -> CpuSnapshot:
        pids = process_tree(self.roots)
        roles: dict[int, str] = {}
        for root, (own, children) in self.role_roots.items():
            for pid in process_tree([root]):
                roles[pid] = own if pid == root else children
        return CpuSnapshot(time.monotonic(), {pid: process_seconds(pid) for pid in pids}, time.process_time(),
                           machine_busy_seconds(), roles)

    @staticmethod
    def between(a: CpuSnapshot, b: CpuSnapshot) -> CpuUse:
        wall = b.wall - a.wall
        if wall <= 0:
            return CpuUse(0.0, 0.0, 0.0, 0.0)
        # A process started in between counts whole; one that ended in between is lost (services
        # under test keep their processes, so this is rare and undercounts).
        service = sum(max(0.0, t - a.service.get(pid, 0.0)) for pid, t in b.service.items()) / wall
        client = (b.client - a.client) / wall
        machine = (b.machine - a.machine) / wall
        roles: dict[str, float] = dict.fromkeys(b.roles.values(), 0.0)
        for pid, role in b.roles.items():
            roles[role] += max(0.0, b.service.get(pid, 0.0) - a.service.get(pid, 0.0)) / wall
        return CpuUse(service, client, max(0.0, machine - service - client), machine, roles)
