"""Celery settings both tiers must share, as plain data (no celery import).

The API's client app and the worker app are built from this, so that what one side writes the other
can read: JSON only on the wire (never pickle from the network), the same queue routing, and the same
Redis visibility timeout for the broker and the result backend.
"""

from __future__ import annotations

from typing import Any

from fleet.redis_url import celery_target
from toxfleet.contract import QUEUE

DEFAULT_VISIBILITY_TIMEOUT = 15
"""`TOXFLEET_VISIBILITY_TIMEOUT`'s default (API and workers alike): seconds after which Redis redelivers
a message whose worker stopped renewing it (died). A live worker renews every message it holds every
quarter of this (`worker.batching`), so it bounds only recovery after a dead worker: about this + 5 s
(kombu's restore scan) + one batch."""

SHARED_CLIENT_TRANSPORT = "fleet.transport:Transport"
"""kombu's Redis transport with one Redis client per channel instead of one per command (`fleet.transport`)."""

SHARED_CLIENT_SENTINEL_TRANSPORT = "fleet.transport:SentinelTransport"
"""The same over kombu's Sentinel transport."""


def celery_config(*, visibility_timeout: int, result_expires: int, redis_url: str = "") -> dict[str, Any]:
    """Settings for `Celery.conf.update`, common to the API and the workers, for the fleet's `REDIS_URL`
    (`fleet.redis_url`; the broker and backend URLs in Celery's spelling are `celery_target(url).url`).
    A `redis://` or `sentinel://` URL gets the shared-client transport; TLS and sockets keep kombu's."""
    target = celery_target(redis_url)
    transport = {
        **target.transport_options,  # Sentinel: the master's name, for the broker and the backend
        "visibility_timeout": visibility_timeout,
        # kombu scans for messages whose consumer died every interval x throttle seconds (default
        # 10 x 10); scanning every 5 s bounds recovery after a whole worker dies to about
        # visibility_timeout + 5 s.
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
        # One worker restores at a time, under a Redis lock that a worker killed -9 mid-scan leaves
        # held until it expires (kombu's default: 300 s, which would hold a dead worker's messages
        # back for five minutes). A scan takes milliseconds; two overlapping are harmless (each
        # message is restored in a WATCH transaction on the unacked hash, once).
        "unacked_mutex_expire": 10,
    }
    # kombu's Redis transport reads several queues round-robin by default; "priority" always asks
    # them in the worker's order (interactive first), so bulk work never delays interactive work.
    broker_transport = {**transport, "queue_order_strategy": "priority"}
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_default_queue": QUEUE,
        "task_routes": {"toxfleet.*": {"queue": QUEUE}},
        "broker_transport_options": broker_transport,
        "result_backend_transport_options": transport,
        "visibility_timeout": visibility_timeout,
        "result_expires": result_expires,
        "broker_connection_retry_on_startup": True,
        # No task-sent events: the worker's one event per request (succeeded/failed) carries the same
        # for Flower, and each event is one more Redis round trip on the submit path.
        "task_send_sent_event": False,
        **({"broker_transport": SHARED_CLIENT_TRANSPORT} if redis_url.startswith("redis://") else {}),
        **({"broker_transport": SHARED_CLIENT_SENTINEL_TRANSPORT} if target.sentinel else {}),
    }
