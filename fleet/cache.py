"""The score cache: moderation traffic repeats itself (spam, copy-paste), so a text scored once is
answered from Redis the next time, without touching the model.

Used by both tiers (pure Redis and hashing, no torch): workers look texts up before scoring and
write what they scored; the API answers a job whose texts are all cached without sending it to a
worker at all.

**Key.** `toxfleet:cache:e:<sha256(model identity, backend, long_text mode, text)>`. A score is only
ever found under the exact model identity, backend and long-text mode (windows: with their overlap)
that computed it, so a cached score from a different model or backend cannot be returned.

**Bounds.** Every entry expires after a TTL. The number of entries is capped with an index (a
sorted set of entry keys by write time) that every write trims: entries older than the TTL leave the
index, and past the cap the entries written longest ago are deleted. The cap holds within a few
concurrent writes; it needs no Redis eviction policy, so the cache may share the broker's Redis,
whose `maxmemory-policy` must stay `noeviction`. For a large cache, point `TOXFLEET_CACHE_URL` at a
separate Redis (or database) instead.

**Stats.** Hits, misses, writes and evictions are counted fleet-wide in one Redis hash (`stats()`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from fleet.keys import CACHE_PREFIX
from toxfleet.contract import WINDOW_OVERLAP_TOKENS, WINDOWS

ENTRY_PREFIX = CACHE_PREFIX + "e:"
"""Redis key prefix of cache entries (JSON `{label: probability}`)."""
INDEX_KEY = CACHE_PREFIX + "index"
"""Sorted set: entry key -> unix time of its last write; enforces the size cap."""
STATS_KEY = CACHE_PREFIX + "stats"
"""Hash of fleet-wide counters: hits, misses, writes, evictions."""

DEFAULT_TTL = 86_400
"""Seconds an entry lives (a day: long enough for a spam wave, short enough to age out)."""

DEFAULT_MAX_ENTRIES = 100_000
"""Most entries kept. Each costs about 0.7 KB of Redis memory with 7 labels (key, JSON scores, index
entry), so the default cap is about 70 MB."""

Scores = dict[str, float]


def namespace(model: str, backend: str, long_text: str) -> str:
    """What a cached score depends on besides the text."""
    mode = f"{WINDOWS}/{WINDOW_OVERLAP_TOKENS}" if long_text == WINDOWS else long_text
    return f"{model}\x00{backend}\x00{mode}"


def entry_key(ns: str, text: str) -> str:
    digest = hashlib.sha256()
    digest.update(ns.encode())
    digest.update(b"\x00")
    digest.update(text.encode("utf-8", "surrogatepass"))  # JSON may carry lone surrogates
    return ENTRY_PREFIX + digest.hexdigest()


def _decode(value: bytes | str | None) -> Scores | None:
    if value is None:
        return None
    try:
        scores = json.loads(value)
    except ValueError:
        return None
    if not isinstance(scores, dict):
        return None
    return {str(k): float(v) for k, v in scores.items()}


def _parse_stats(raw: dict[Any, Any], entries: int) -> dict[str, int]:
    stats = {"hits": 0, "misses": 0, "writes": 0, "evictions": 0}
    for k, v in raw.items():
        stats[k.decode() if isinstance(k, bytes) else str(k)] = int(v)
    stats["entries"] = entries
    return stats


class ScoreCache:
    """The cache over a synchronous Redis client (workers)."""

    def __init__(self, client: redis.Redis, ttl: int = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if ttl < 1 or max_entries < 1:
            raise ValueError("cache ttl and max_entries must be positive")
        self.client = client
        self.ttl = ttl
        self.max_entries = max_entries

    def get(self, ns: str, texts: Sequence[str], count: bool = True) -> list[Scores | None]:
        """Cached scores per text (None where absent), in one MGET; counts hits and misses."""
        if not texts:
            return []
        found = [_decode(v) for v in self.client.mget([entry_key(ns, t) for t in texts])]
        if count:
            hits = sum(f is not None for f in found)
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hincrby(STATS_KEY, "hits", hits)
                pipe.hincrby(STATS_KEY, "misses", len(texts) - hits)
                pipe.execute()
        return found

    def put(self, ns: str, texts: Sequence[str], scores: Sequence[Scores]) -> None:
        """Store scores and keep the cache within its TTL and size cap (one round trip, two past the cap)."""
        if not texts:
            return
        now = time.time()
        entries = {entry_key(ns, t): json.dumps(s) for t, s in zip(texts, scores, strict=True)}
        with self.client.pipeline(transaction=False) as pipe:
            for key, value in entries.items():
                pipe.set(key, value, ex=self.ttl)
            pipe.zadd(INDEX_KEY, dict.fromkeys(entries, now))
            pipe.zremrangebyscore(INDEX_KEY, "-inf", now - self.ttl)  # expired by their TTL already
            pipe.hincrby(STATS_KEY, "writes", len(entries))
            pipe.zcard(INDEX_KEY)
            size = int(pipe.execute()[-1])
        if size > self.max_entries:
            self._evict(size - self.max_entries)

    def _evict(self, n: int) -> None:
        popped: Any = self.client.zpopmin(INDEX_KEY, n)  # [(member, score)]
        oldest: list[bytes] = [member for member, _ in popped]
        if oldest:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.delete(*oldest)
                pipe.hincrby(STATS_KEY, "evictions", len(oldest))
                pipe.execute()

    def stats(self) -> dict[str, int]:
        """Fleet-wide counters since the cache was created, and the entries it holds now."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(STATS_KEY)
            pipe.zcard(INDEX_KEY)
            raw, entries = pipe.execute()
        return _parse_stats(raw, int(entries))


class AsyncScoreCache:
    """Lookups over an asyncio Redis client (the API reads; only workers write)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self, ns: str, texts: Sequence[str]) -> list[Scores | None]:
        """Cached scores per text (None where absent), in one MGET; counts nothing (see `count_hits`)."""
        if not texts:
            return []
        return [_decode(v) for v in await self.client.mget([entry_key(ns, t) for t in texts])]

    async def entries(self) -> int:
        return int(await self.client.zcard(INDEX_KEY))

    async def count_hits(self, hits: int) -> None:
        await self.client.hincrby(STATS_KEY, "hits", hits)

    async def stats(self) -> dict[str, int]:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(STATS_KEY)
            pipe.zcard(INDEX_KEY)
            raw, entries = await pipe.execute()
        return _parse_stats(raw, int(entries))
