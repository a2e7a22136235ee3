"""Both tiers parse Redis replies in C: `redis[hiredis]` is in the `core` extra, and redis-py picks
hiredis up by itself only when it imports (issue 11: the pure-Python RESP3 parser was 7-15 % of the
API's, the worker's and the pool's CPU per job). A failed or dropped install would only slow
everything down, silently; this says so."""

from __future__ import annotations

import redis.asyncio.connection as async_connection
import redis.connection as sync_connection
from redis._parsers import _AsyncHiredisParser, _HiredisParser


def test_sync_and_asyncio_clients_use_hiredis() -> None:
    assert sync_connection.DefaultParser is _HiredisParser
    assert async_connection.DefaultParser is _AsyncHiredisParser
