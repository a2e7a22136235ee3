"""The API's Prometheus endpoint, on a listener of its own (`TOXFLEET_API_METRICS_HOST:PORT`, default
127.0.0.1:9809), never on the public port: the load balancer forwards the API port only, so
`/metrics` is a 404 there whatever the ALB's rules say.

prometheus_client's HTTP server runs in a daemon thread of this uvicorn process (one process per
container: a second process on the same port fails at start, naming the setting). At each scrape the
thread reads the queue, the score cache and the workers' heartbeats from Redis with the app's own async
client, on the app's event loop (`run_coroutine_threadsafe`): no second Redis client, and the event
loop never blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, start_http_server
from redis.exceptions import RedisError

from api.metrics import UNREAD, FleetCollector, FleetReading
from api.services.fleet import FleetService
from api.settings import ApiSettings

logger = logging.getLogger(__name__)

READ_SLACK = 2.0
"""Seconds a scrape waits for the event loop beyond its four Redis round trips' own timeouts; past that
the scrape reports the broker down rather than hang (a scraper's timeout is typically 10 s)."""


async def read_fleet(fleet: FleetService) -> FleetReading:
    """The backlog, the cache size and the live workers' heartbeats; a read Redis did not answer is None."""
    try:
        backlog = await fleet.backlog()
    except RedisError:
        backlog = None
    try:
        entries = await fleet.cache_entries()
    except RedisError:  # the cache may live on its own Redis
        entries = None
    try:
        workers = await fleet.workers() if backlog is not None else None
    except RedisError:
        workers = None
    return FleetReading(backlog, entries, workers)


@dataclass
class MetricsServer:
    """The running listener; `stop()` closes it and unregisters the fleet gauges."""

    httpd: WSGIServer
    thread: threading.Thread
    collector: FleetCollector

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
        REGISTRY.unregister(self.collector)


def start(settings: ApiSettings, fleet: FleetService, loop: asyncio.AbstractEventLoop) -> MetricsServer:
    """Serve the default registry plus the fleet gauges on the metrics port; raise if it is taken."""
    timeout = 4 * settings.redis_timeout + READ_SLACK

    def read() -> FleetReading:
        future = asyncio.run_coroutine_threadsafe(read_fleet(fleet), loop)
        try:
            return future.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return UNREAD

    collector = FleetCollector(read)
    REGISTRY.register(collector)
    host, port = settings.api_metrics_host, settings.api_metrics_port
    try:
        httpd, thread = start_http_server(port, addr=host)
    except OSError as exc:
        REGISTRY.unregister(collector)
        raise RuntimeError(f"TOXFLEET_API_METRICS_PORT: cannot serve metrics on {host}:{port} ({exc}); "
                           "run one API process per port, choose a free port, or 0 for no metrics") from exc
    logger.info("metrics: serving Prometheus metrics on http://%s:%d/metrics", host, httpd.server_address[1])
    return MetricsServer(httpd, thread, collector)
