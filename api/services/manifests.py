"""Manifests this API process just wrote, kept so that the GET which usually follows a submit (a
long-poll, or the compatibility endpoints' wait) need not read them back from Redis.

Bounded in entries and in age: an entry older than `MANIFEST_TTL` (or the manifest's own expiry) is
read from Redis again, so a manifest changed or deleted in Redis is seen within that time at most.
A process that changes or deletes a manifest itself calls `forget`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

MANIFEST_TTL = 10.0
"""Seconds a written manifest is served from memory: long enough for the reads that follow a submit."""

MANIFEST_ENTRIES = 4096
"""At most this many manifests held (the oldest written are dropped first)."""


class ManifestCache:
    """job id -> manifest, for the manifests this process wrote in the last few seconds."""

    def __init__(self, ttl: float = MANIFEST_TTL, entries: int = MANIFEST_ENTRIES) -> None:
        self._ttl = ttl
        self._entries = entries
        self._held: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def put(self, job_id: str, manifest: dict[str, Any]) -> None:
        self._held[job_id] = (time.monotonic() + self._ttl, manifest)
        self._held.move_to_end(job_id)
        while len(self._held) > self._entries:
            self._held.popitem(last=False)

    def get(self, job_id: str) -> dict[str, Any] | None:
        held = self._held.get(job_id)
        if held is None:
            return None
        if time.monotonic() >= held[0]:
            del self._held[job_id]
            return None
        return held[1]

    def forget(self, job_id: str) -> None:
        self._held.pop(job_id, None)
