"""toxfleet's kombu transport against a real Redis: acks made in one iteration of the worker's event
loop reach Redis together, at its end."""

from __future__ import annotations

from kombu.asynchronous import Hub
from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from fleet.transport import Transport
from testing import RedisServer


def _publish(conn: Connection, n: int) -> None:
    """n messages on queue "q", which this declares."""
    queue = Queue("q", Exchange("q"), routing_key="q")  # type: ignore[no-untyped-call]
    producer = conn.Producer(channel=conn.default_channel)
    for i in range(n):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="q", declare=[queue])


def _three_delivered(conn: Connection) -> list[object]:
    _publish(conn, 3)
    channel = conn.default_channel
    channel.basic_qos(prefetch_size=0, prefetch_count=3, apply_global=False)
    return [channel.basic_get("q") for _ in range(3)]


def test_acks_in_a_loop_iteration_are_one_round_trip_at_its_end(clean_redis: RedisServer) -> None:
    """Until the loop's tick the acked messages stay unacked in Redis (a crash there means redelivery,
    never loss); then one ZREM and one HDEL remove them all, and the consumer's prefetch is released."""
    hub = Hub()
    with Connection(clean_redis.url, transport=Transport) as conn:
        messages = _three_delivered(conn)
        channel = conn.default_channel
        conn.transport.register_with_event_loop(conn.connection, hub)
        r = clean_redis.client()
        assert r.hlen("unacked") == 3 == r.zcard("unacked_index") and not channel.qos.can_consume()
        r.config_resetstat()
        for m in messages:
            m.ack()  # type: ignore[attr-defined]
        assert r.hlen("unacked") == 3  # held until the iteration ends
        for tick in list(hub.on_tick):
            tick()
        assert r.hlen("unacked") == 0 == r.zcard("unacked_index")
        stats = r.info("commandstats")
        assert stats["cmdstat_zrem"]["calls"] == 1 and stats["cmdstat_hdel"]["calls"] == 1
        assert channel.qos.can_consume()
    hub.close()


def test_without_an_event_loop_an_ack_goes_at_once(clean_redis: RedisServer) -> None:
    """A connection no loop drives (the API's, a script's) acks each message when asked."""
    with Connection(clean_redis.url, transport=Transport) as conn:
        _three_delivered(conn)[0].ack()  # type: ignore[attr-defined]
        assert clean_redis.client().hlen("unacked") == 2


def test_closing_the_channel_sends_what_is_held(clean_redis: RedisServer) -> None:
    hub = Hub()
    with Connection(clean_redis.url, transport=Transport) as conn:
        messages = _three_delivered(conn)
        conn.transport.register_with_event_loop(conn.connection, hub)
        messages[0].ack()  # type: ignore[attr-defined]
        conn.default_channel.close()
    r = clean_redis.client()
    # The acked one is gone; the two never acked are back in the queue (kombu restores them on close).
    assert r.hlen("unacked") == 0 and r.llen("q") == 2
    hub.close()


def test_an_ack_frees_its_prefetch_slot_before_the_loop_decides_to_fetch(clean_redis: RedisServer) -> None:
    """At a prefetch of one the held message's ack must land before kombu decides, in the same loop
    iteration, which channels may BRPOP, whatever order the loop runs its tick callbacks in (a set):
    otherwise the next message waited for the next timer to wake the loop (up to 1 s a message)."""
    for first in range(2):  # each tick callback runs first once (sorted by name: a set has no order)
        hub = Hub()
        with Connection(clean_redis.url, transport=Transport) as conn:
            _publish(conn, 2)
            channel = conn.default_channel
            channel.basic_qos(prefetch_size=0, prefetch_count=1, apply_global=False)
            held = channel.basic_get("q")
            channel.basic_consume("q", no_ack=False, callback=lambda message: None, consumer_tag="c")
            conn.transport.register_with_event_loop(conn.connection, hub)
            assert not channel.qos.can_consume()
            held.ack()  # type: ignore[attr-defined]
            ticks = sorted(hub.on_tick, key=lambda tick: tick.__qualname__)
            start = first % len(ticks)
            for tick in ticks[start:] + ticks[:start]:
                tick()
            assert channel.qos.can_consume()
            assert channel._in_poll, f"the ack freed the slot, yet no BRPOP was sent in this iteration ({ticks})"
        hub.close()


def test_deliveries_in_a_loop_iteration_are_recorded_with_its_acks_in_one_round_trip(
        clean_redis: RedisServer) -> None:
    """kombu records each popped message in the unacked hash (a ZADD and an HSET, its own MULTI/EXEC);
    on a loop-driven connection those of one iteration wait for its end and go in the pipeline of
    its acks: one MULTI/EXEC for all of them, kombu's record unchanged."""
    hub = Hub()
    with Connection(clean_redis.url, transport=Transport) as conn:
        acked = _three_delivered(conn)  # recorded at once: no loop yet
        channel = conn.default_channel
        conn.transport.register_with_event_loop(conn.connection, hub)
        _publish(conn, 2)
        channel.basic_qos(prefetch_size=0, prefetch_count=5, apply_global=False)
        r = clean_redis.client()
        r.config_resetstat()
        fresh = [channel.basic_get("q") for _ in range(2)]
        for m in acked:
            m.ack()  # type: ignore[attr-defined]
        assert r.hlen("unacked") == 3  # neither the two records nor the three acks sent yet
        for tick in list(hub.on_tick):
            tick()
        tags = {m.delivery_tag for m in fresh}  # type: ignore[attr-defined]
        assert set(r.hkeys("unacked")) == {t.encode() for t in tags} == set(r.zrange("unacked_index", 0, -1))
        stats = r.info("commandstats")
        assert stats["cmdstat_exec"]["calls"] == 1 and stats["cmdstat_hset"]["calls"] == 2, stats
        # kombu's own record: what a restore reads back.
        channel.basic_reject(fresh[0].delivery_tag, requeue=True)  # type: ignore[attr-defined]
        assert r.llen("q") == 1
    hub.close()


def test_a_held_delivery_is_recorded_before_anything_reads_it_back(clean_redis: RedisServer) -> None:
    """A reject (requeue) or the channel's close in the iteration that delivered the message finds
    its unacked record: nothing popped is dropped for want of it."""
    hub = Hub()
    with Connection(clean_redis.url, transport=Transport) as conn:
        _publish(conn, 3)
        channel = conn.default_channel
        channel.basic_qos(prefetch_size=0, prefetch_count=3, apply_global=False)
        conn.transport.register_with_event_loop(conn.connection, hub)
        messages = [channel.basic_get("q") for _ in range(3)]
        r = clean_redis.client()
        assert r.hlen("unacked") == 0 and r.llen("q") == 0
        channel.basic_reject(messages[0].delivery_tag, requeue=True)  # type: ignore[attr-defined]
        assert r.llen("q") == 1 and r.hlen("unacked") == 2
        channel.close()  # kombu restores the two still unacked
    assert r.hlen("unacked") == 0 and r.llen("q") == 3
    hub.close()
