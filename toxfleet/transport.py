"""kombu's Redis transport, reusing one Redis client per channel (`broker_transport` in celeryconf).

kombu builds a new `redis.Redis` object for every publish, ack and pipeline
(`Channel.conn_or_acquire` -> `_create_client`): about 0.1 ms of Python each, several times per job
in the worker's main process and once per message in the API. A client object holds no per-command
state (each command takes a connection from the pool, which is thread-safe), so one per channel and
pool serves every caller, the API's sending threads included. A new pool (kombu makes one after a
disconnect) gets a new client.

`SentinelTransport` does the same over kombu's Sentinel transport: its channel's pool is the one
redis-py's Sentinel keeps for the current master (a connection asks the sentinels where the master
is when it connects), so a shared client follows a failover as kombu's own clients do.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class _SharedClient:
    """Mixin for a kombu Redis channel: one synchronous client per pool instead of one per call."""

    _shared_client: Any = None
    pool: Any

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        client = self._shared_client
        if client is None or client.connection_pool is not self.pool:
            client = self._shared_client = super()._create_client()  # type: ignore[misc]
        return client


class Channel(_SharedClient, kombu_redis.Channel):  # type: ignore[misc]
    pass


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


class SentinelChannel(_SharedClient, kombu_redis.SentinelChannel):  # type: ignore[misc]
    pass


class SentinelTransport(kombu_redis.SentinelTransport):  # type: ignore[misc]
    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"
"""The `broker_transport` setting naming this transport."""

SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
"""The same over Redis Sentinel (`sentinel://` broker URLs)."""
