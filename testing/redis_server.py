"""A private redis-server on a free port, so tests never touch a Redis the developer uses."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis

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
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.appendonly \
            else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        wait_for(lambda: bool(client.ping()), 10, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
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
