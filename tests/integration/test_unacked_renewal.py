"""`fleet.transport.renew_deliveries` against a real Redis and real kombu channels: it moves the entry
kombu itself wrote for a delivered message, under kombu's key (prefixed as kombu prefixes it), and
never adds one for a message kombu no longer holds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from fleet.celeryconf import SHARED_CLIENT_TRANSPORT
from fleet.transport import renew_deliveries
from testing import RedisServer


@pytest.fixture(params=["toxfleet", "kombu"])
def transport(request: pytest.FixtureRequest) -> str:
    """This project's shared-client transport (`redis://`, `sentinel://`) and kombu's own (`rediss://`,
    `unix://` brokers): the workers renew through either."""
    return SHARED_CLIENT_TRANSPORT if request.param == "toxfleet" else "redis"


@pytest.fixture(params=["", "fleet-a:"], ids=["no-prefix", "global-keyprefix"])
def channel(request: pytest.FixtureRequest, transport: str, clean_redis: RedisServer) -> Iterator[Any]:
    options = {"global_keyprefix": request.param} if request.param else {}
    with Connection(clean_redis.url, transport=transport, transport_options=options) as conn:
        yield conn.default_channel


def _deliver(channel: Any, body: str) -> Any:
    queue = Queue("renewal-test", Exchange("renewal-test"), routing_key="renewal-test")
    queue(channel).declare()
    channel.basic_publish(channel.prepare_message(body), exchange="renewal-test", routing_key="renewal-test")
    message = channel.basic_get("renewal-test", no_ack=False)  # delivered, unacked: kombu indexes it
    assert message is not None
    return message


def test_renews_what_kombu_indexed_under_its_own_key(channel: Any, clean_redis: RedisServer) -> None:
    prefix = channel.global_keyprefix
    message = _deliver(channel, "held")
    tag = message.delivery_tag
    raw = clean_redis.client()
    index = prefix + channel.qos.unacked_index_key
    delivered_at = raw.zscore(index, tag)
    assert delivered_at is not None and abs(delivered_at - time.time()) < 5  # kombu's own write, found by that name
    later = time.time() + 100
    assert renew_deliveries(channel, [tag], later) == 1
    assert raw.zscore(index, tag) == pytest.approx(later)
    # Nothing is written outside kombu's keys (a second, unprefixed index would be restored by nobody).
    assert set(raw.keys("*unacked_index*")) == {index.encode()}


def test_a_tag_kombu_no_longer_holds_is_not_put_back(channel: Any, clean_redis: RedisServer) -> None:
    message = _deliver(channel, "acked")
    tag = message.delivery_tag
    channel.basic_ack(tag)  # kombu removes it from the unacked hash and index
    index = channel.global_keyprefix + channel.qos.unacked_index_key
    assert renew_deliveries(channel, [tag, "never-delivered"], time.time()) == 0
    assert clean_redis.client().zcard(index) == 0
