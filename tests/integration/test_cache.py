"""The score cache against a real Redis: keys by model identity, backend and mode; TTL; size cap; stats."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from fleet import cache as score_cache
from fleet.cache import AsyncScoreCache, ScoreCache, namespace
from testing import RedisServer


@pytest.fixture
def cache(clean_redis: RedisServer) -> ScoreCache:
    return ScoreCache(clean_redis.client(), ttl=300, max_entries=5)


def test_round_trip_exact_floats(cache: ScoreCache) -> None:
    """What is put is got back bit for bit; absent texts are None."""
    ns = namespace("m", "torch", "truncate")
    scores = [{"toxicity": 0.1234567890123456, "insult": 1e-7}, {"toxicity": 0.5, "insult": 0.25}]
    cache.put(ns, ["a", "b"], scores)
    assert cache.get(ns, ["b", "zzz", "a"]) == [scores[1], None, scores[0]]


def test_other_model_backend_or_mode_never_sees_an_entry(cache: ScoreCache) -> None:
    """A score cached for one model identity, backend or long-text mode is a miss for every other."""
    cache.put(namespace("m", "torch", "truncate"), ["text"], [{"toxicity": 0.9}])
    for ns in (namespace("m2", "torch", "truncate"), namespace("m", "onnx", "truncate"),
               namespace("m", "torch", "windows")):
        assert cache.get(ns, ["text"]) == [None]
    assert cache.get(namespace("m", "torch", "truncate"), ["text"]) == [{"toxicity": 0.9}]


def test_entries_expire_with_the_ttl(cache: ScoreCache) -> None:
    """Every entry is written with the configured TTL."""
    ns = namespace("m", "torch", "truncate")
    cache.put(ns, ["t"], [{"toxicity": 0.3}])
    ttl = cache.client.ttl(score_cache.entry_key(ns, "t"))
    assert 290 < ttl <= 300


def test_size_cap_evicts_the_oldest_entries(cache: ScoreCache) -> None:
    """Past max_entries, the entries written longest ago are deleted, newer ones kept; evictions counted."""
    ns = namespace("m", "torch", "truncate")
    for i in range(8):
        cache.put(ns, [f"t{i}"], [{"toxicity": i / 10}])
    found = cache.get(ns, [f"t{i}" for i in range(8)], count=False)
    assert found[:3] == [None] * 3
    assert found[3:] == [{"toxicity": i / 10} for i in range(3, 8)]
    stats = cache.stats()
    assert stats["entries"] == 5 and stats["evictions"] == 3 and stats["writes"] == 8


def test_hits_and_misses_are_counted(cache: ScoreCache, redis_server: RedisServer) -> None:
    """Lookups count hits and misses fleet-wide; the async reader sees the same entries and stats."""
    ns = namespace("m", "torch", "truncate")
    cache.put(ns, ["a"], [{"toxicity": 0.4}])
    cache.get(ns, ["a", "b", "a"])

    async def read() -> tuple[list[dict[str, float] | None], dict[str, int]]:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            reader = AsyncScoreCache(client)
            return await reader.get(ns, ["a", "c"]), await reader.stats()
        finally:
            await client.aclose()

    found, stats = asyncio.run(read())
    assert found == [{"toxicity": 0.4}, None]
    assert (stats["hits"], stats["misses"], stats["entries"]) == (2, 1, 1)


def test_texts_with_lone_surrogates_are_keyed(cache: ScoreCache) -> None:
    """A text JSON can carry but UTF-8 cannot (a lone surrogate) still gets a key of its own."""
    ns = namespace("m", "torch", "truncate")
    cache.put(ns, ["\ud800x"], [{"toxicity": 0.2}])
    assert cache.get(ns, ["\ud800x", "\ud801x"]) == [{"toxicity": 0.2}, None]
