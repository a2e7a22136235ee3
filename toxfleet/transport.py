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

`renew_deliveries` moves messages a live consumer still holds to the front of kombu's unacked index,
so that kombu's restore (which redelivers what has sat there longer than the visibility timeout)
takes only the messages of a consumer that stopped renewing them: a dead one.
"""

from __future__ import annotations

from collections.abc import Collection
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


def renew_deliveries(channel: Any, delivery_tags: Collection[str], now: float) -> int:
    """Set the delivery time kombu's Redis transport keeps for each of `delivery_tags` (messages
    `channel` delivered and that are not acked yet) to `now`, in one `ZADD ... XX CH`; returns how many
    were renewed. kombu restores (redelivers) a message once its time there is older than the
    visibility timeout (`QoS.restore_visible`), so a consumer that calls this more often than that
    keeps what it holds, however long it holds it, and one that died stops calling it.

    The index is named by kombu's own QoS (`unacked_index_key`, a transport option) and written
    through the channel's own client, so kombu's `global_keyprefix` and a Sentinel channel's current
    master apply as to kombu's writes: nothing here spells kombu's format a second time. `XX` only
    moves entries that are still there: a tag acked or restored meanwhile (its entry removed by
    kombu) is not put back, which would leave an index entry with no message behind it. Works on any
    kombu Redis channel (this module's and kombu's own, as `rediss://` and `unix://` brokers use);
    a channel of another transport has no such index, and nothing is done (0)."""
    qos = channel.qos
    key = getattr(qos, "unacked_index_key", None)
    if key is None or not delivery_tags:
        return 0
    with channel.conn_or_acquire() as client:
        return int(client.zadd(key, dict.fromkeys(delivery_tags, now), xx=True, ch=True))


TRANSPORT = f"{__name__}:Transport"
"""The `broker_transport` setting naming this transport."""

SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
"""The same over Redis Sentinel (`sentinel://` broker URLs)."""
