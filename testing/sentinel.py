"""A private Redis Sentinel group on loopback: a primary, a replica and three sentinels (quorum 2),
as a highly available Redis runs it, with a short failure detection so that a failover takes seconds.

`redis-server --sentinel` (or Valkey's) runs a sentinel; Debian's `redis-sentinel` is the same binary.
"""

from __future__ import annotations

import signal
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

    def cut_off_replica(self, primary: int, replica: int) -> int:
        """Leave the replica behind, as a replica lagging when its primary dies is: it is stopped
        (SIGSTOP), then the primary is made to drop its link by a write larger than the replica's
        output buffer may hold (kernel socket buffers included). Every write after this reaches the
        primary only: a replica can't reconnect while it is stopped. `resume` wakes it; the half
        write it had received is discarded at the broken link, as Redis discards any incomplete command.
        Returns the primary's replication offset at the cut."""
        node = self.node(primary)
        node.config_set("client-output-buffer-limit", "replica 1mb 0 0")
        self.procs[replica].send_signal(signal.SIGSTOP)
        node.set("toxfleet-test:lag-filler", b"x" * (64 << 20))  # far past the 1 MB limit and ~10 MB of socket buffers
        wait_for(lambda: node.info("replication")["connected_slaves"] == 0, 10, "the primary to drop its replica",
                 interval=0.05)
        node.delete("toxfleet-test:lag-filler")
        return self.offset(primary)

    def offset(self, port: int) -> int:
        """The replication offset a node reports: bytes of writes it has sent (a primary) or applied."""
        return int(self.node(port).info("replication")["master_repl_offset"])

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

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
            proc.send_signal(signal.SIGCONT)  # a stopped node would not act on the SIGTERM
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
