"""kombu's Redis transport, reusing one Redis client per channel (`broker_transport` in celeryconf).

kombu builds a new `redis.Redis` object for every publish, ack and pipeline
(`Channel.conn_or_acquire` -> `_create_client`): Python work each time, several times per job
in the worker's main process and once per message in the API. A client object holds no per-command
state (each command takes a connection from the pool, which is thread-safe), so one per channel and
pool serves every caller, the API's sending threads included. A new pool (kombu makes one after a
disconnect) gets a new client.

Acks also go together: kombu acks each message with its own pipeline (ZREM and HDEL in MULTI/EXEC, a
round trip), and a worker that finishes a batch of n requests acks n messages in the same iteration of
its event loop; they are held and removed from the unacked index in one pipeline at its end, just
before kombu decides which channels may fetch (`_Poller.on_poll_start`): an ack frees a prefetch slot.
Deliveries go in the same pipeline: kombu copies each message it pops into the unacked hash with a
pipeline of its own (ZADD and HSET, a round trip per message, a large part of the worker's main process
on a small model); held, they land at the end of the iteration that delivered them, before
its acks, and before anything that reads them back (a reject, a restore, the channel's close).

`SentinelTransport` does the same over kombu's Sentinel transport: its channel's pool is the one
redis-py's Sentinel keeps for the current master (a connection asks the sentinels where the master
is when it connects), so a shared client follows a failover as kombu's own clients do.

`renew_deliveries` moves messages a live consumer still holds to the front of kombu's unacked index,
so that kombu's restore (which redelivers what has sat there longer than the visibility timeout)
takes only the messages of a consumer that stopped renewing them: a dead one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

logger = logging.getLogger(__name__)


class _Held:
    """What kombu's `QoS.append` gets as its pipeline while deliveries are held: it queues the
    commands on the iteration's pipeline and leaves them there when kombu calls `execute()`. kombu
    still writes its own unacked record; only the round trip moves (if a kombu version stops asking
    `pipe_or_acquire` for that pipeline, its deliveries simply go at once again)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._pipe, name)

        def queue(*args: Any, **kwargs: Any) -> _Held:
            command(*args, **kwargs)
            return self

        return queue

    def execute(self) -> None:
        return None


class QoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's Redis ack emulation; on a transport driven by an event loop (the worker's consumer),
    deliveries and acks are held and sent together once per loop iteration (`flush_acks`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._held_acks: list[str] = []
        self._deliveries: Any = None  # the pipeline holding this iteration's unacked records
        self._holding = False  # inside kombu's append, whose pipeline is then `_deliveries`

    def _per_tick(self) -> bool:
        return bool(getattr(self.channel.connection, "acks_per_tick", False))

    def _pipeline(self, client: Any = None) -> Any:
        """A new pipeline, as kombu's `pipe_or_acquire` makes one (a channel's client holds nothing
        to release: the pipeline may outlive the `with`)."""
        with self.channel.conn_or_acquire(client) as conn:
            return conn.pipeline()

    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Iterator[Any]:
        if pipe is None and self._holding:
            if self._deliveries is None:
                self._deliveries = self._pipeline(client)
            yield _Held(self._deliveries)
            return
        with super().pipe_or_acquire(pipe, client) as acquired:
            yield acquired

    def append(self, message: Any, delivery_tag: str) -> None:
        if not self._per_tick():
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        self._holding = True
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        finally:
            self._holding = False

    def ack(self, delivery_tag: str) -> None:
        if self._per_tick():
            self._held_acks.append(delivery_tag)
        else:  # deliveries are held only per tick too: none waits here
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self.flush_deliveries()  # a requeue reads the unacked record back
        super().reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> None:
        self.flush_deliveries()
        super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def flush_deliveries(self) -> None:
        """Send the held unacked records (see `flush_acks`)."""
        pipe, self._deliveries = self._deliveries, None
        if pipe is not None:
            pipe.execute()

    def flush_acks(self) -> None:
        """Write the held deliveries' unacked records, then remove the held acks' messages from the
        unacked index, in one pipeline. Holding an ack back is always safe: until it lands the message
        is still unacked in Redis, and at worst (the process dies in between, or Redis is away) it is
        restored and delivered again, as any unacked message is; the worker skips a request whose
        result is already stored. Holding a delivery's record to the end of its iteration widens
        kombu's own gap between the pop and the record (a worker killed in it loses the popped
        message) from one round trip to one iteration: `worker.sweeper` re-sends such a message."""
        held, self._held_acks = self._held_acks, []
        pipe, self._deliveries = self._deliveries, None
        if not held and pipe is None:
            return
        try:
            pipe = pipe if pipe is not None else self._pipeline()
            if held:
                pipe.zrem(self.unacked_index_key, *held).hdel(self.unacked_key, *held)
            pipe.execute()
        except Exception as exc:  # as kombu's Message.ack_log_error: logged, and the messages come back
            # The acked messages come back; a delivered one without its record is re-sent by the
            # sweeper if this worker dies before acking it (as when kombu's own append fails).
            logger.error("could not write this loop iteration's deliveries and %d acks (%r); Redis delivers "
                         "the acked messages again", len(held), exc)
        finally:
            # The consumer's prefetch count is released either way.
            for tag in held:
                virtual.QoS.ack(self, tag)  # type: ignore[no-untyped-call]


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


class _Poller(kombu_redis.MultiChannelPoller):  # type: ignore[misc]
    """kombu's poller, which sends the held acks (`flush`) before it decides, once per loop
    iteration, which channels may BRPOP. The order matters: a channel whose prefetch window is full
    fetches nothing, and only the ack frees its slot. Run as a separate `on_tick` callback (a set, in
    no fixed order) the flush could follow that decision, and the channel then waited for the next
    timer to wake the loop (up to 1 s per message at a prefetch of one)."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._flush = flush

    def on_poll_start(self) -> None:
        self._flush()
        super().on_poll_start()  # type: ignore[no-untyped-call]


class _HeldAcks:
    """Mixin for a kombu Redis transport: acks made while the event loop runs go out together once
    per loop iteration (`_Poller`). Celery acks each finished request through `hub.call_soon`, so a
    batch's acks all run in one iteration: n pipelines become one."""

    acks_per_tick = False
    channels: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = _Poller(self._flush_acks)  # kombu's own, made in its __init__, has no channel yet

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)  # type: ignore[misc]
        self.acks_per_tick = True

    def _flush_acks(self) -> None:
        for channel in self.channels:
            qos = channel._qos  # kombu makes it on first use: never create one here
            if qos is not None:
                qos.flush_acks()


class Channel(_SharedClient, kombu_redis.Channel):  # type: ignore[misc]
    QoS = QoS

    def close(self) -> None:
        if self._qos is not None:
            self._qos.flush_acks()  # what is still held lands before kombu restores what was never acked
        super().close()  # type: ignore[no-untyped-call]


class Transport(_HeldAcks, kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


class SentinelChannel(_SharedClient, kombu_redis.SentinelChannel):  # type: ignore[misc]
    QoS = QoS

    def close(self) -> None:
        if self._qos is not None:
            self._qos.flush_acks()
        super().close()  # type: ignore[no-untyped-call]


class SentinelTransport(_HeldAcks, kombu_redis.SentinelTransport):  # type: ignore[misc]
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
