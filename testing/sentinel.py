"""A private Redis Sentinel group on loopback: a primary, a replica and three sentinels (quorum 2),
as a highly available Redis runs it, with a short failure detection so that a failover takes seconds.

`redis-server --sentinel` (or Valkey's) runs a sentinel; Debian's `redis-sentinel` is the same binary.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from scripts.redis_server import command, server_binary
from testing.processes import free_port, wait_for

MASTER = "toxfleet"
"""The name the sentinels monitor the primary under (the `?master=` of the fleet's URL)."""


@dataclass
class SentinelGroup:
    workdir: Path
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    sentinels: int = 3
    """0: only the primary and its replica (no failover)."""
    ports: list[int] = field(default_factory=list)
    """The data nodes: the first is the primary at start, the second its replica."""
    sentinel_ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"sentinel://{hosts}/0?master={MASTER}"

    def _spawn(self, port: int, args: list[str]) -> None:
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self.ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(self.sentinels)]
        primary, replica = self.ports
        for port, extra in ((primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
            node_dir = self.workdir / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self._spawn(port, [*command(port, node_dir, persist=False), *extra])
        wait_for(lambda: self.node(replica).info("replication")["master_link_status"] == "up", 20,
                 "the replica to sync")
        for port in self.sentinel_ports:
            conf = self.workdir / f"sentinel-{port}.conf"  # a sentinel rewrites its own file: one each
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
                            f"sentinel parallel-syncs {MASTER} 1\n")
            self._spawn(port, [server_binary(), str(conf), "--sentinel", "--loglevel", "warning"])

        def all_see_everyone() -> bool:
            for port in self.sentinel_ports:
                state: dict[str, Any] = self.node(port).sentinel_master(MASTER)  # type: ignore[no-untyped-call,assignment]
                if state["num-other-sentinels"] < 2 or state["num-slaves"] < 1:
                    return False
            return True

        if self.sentinel_ports:
            wait_for(all_see_everyone, 30, "the sentinels to find each other and the replica", interval=0.1)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def master_port(self, sentinel: int | None = None) -> int:
        """The primary as a sentinel (the first) names it now."""
        node = self.node(self.sentinel_ports[0] if sentinel is None else sentinel)
        address: tuple[str, int] = node.sentinel_get_master_addr_by_name(MASTER)  # type: ignore[no-untyped-call,assignment]
        return int(address[1])

    def kill(self, port: int) -> None:
        """SIGKILL a node, as a crash or the loss of its host would end it."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def wait_for_failover(self, old: int, timeout: float = 30) -> float:
        """Seconds until every sentinel names a new primary and that node says it is one."""
        t0 = time.monotonic()

        def promoted() -> bool:
            if any(self.master_port(port) == old for port in self.sentinel_ports):
                return False
            return bool(self.node(self.master_port()).info("replication")["role"] == "master")

        wait_for(promoted, timeout, "a sentinel failover", interval=0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
