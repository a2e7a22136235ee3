"""A one-line progress report on stderr: rows done of total, rate and ETA.

On a terminal the line redraws in place a few times a second; otherwise (a log file, CI) a full line
is printed every `LOG_EVERY` seconds, so the log stays readable. No dependency (tqdm is not part of
the client's install).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_EVERY = 0.2
"""Seconds between redraws on a terminal."""

LOG_EVERY = 10.0
"""Seconds between lines when stderr is not a terminal."""


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Counts rows done this run on top of `initial` already done, out of `total`."""

    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.initial = initial
        self.done = 0
        self.failed = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._enabled = enabled
        self._start = time.monotonic()
        self._last = 0.0

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        finished = self.initial + self.done
        pct = 100.0 * finished / self.total if self.total else 100.0
        rate = self.rate
        eta = duration((self.total - finished) / rate) if rate > 0 else "?"
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{finished}/{self.total} rows ({pct:.1f}%{failed})  {rate:.1f} rows/s  ETA {eta}"

    def update(self, done: int, failed: int = 0) -> None:
        self.done += done
        self.failed += failed
        now = time.monotonic()
        if not self._enabled or now - self._last < (REDRAW_EVERY if self._tty else LOG_EVERY):
            return
        self._last = now
        self._stream.write(("\r" + self.line() + "\x1b[K") if self._tty else self.line() + "\n")
        self._stream.flush()

    def close(self, message: str) -> None:
        if self._enabled and self._tty:
            self._stream.write("\r\x1b[K")
        self._stream.write(message + "\n")
        self._stream.flush()
