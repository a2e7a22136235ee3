"""Prometheus metrics of the HTTP tier (see docs/observability.md); `api.metrics_server` serves them
on a listener of their own, never on the public port.

Requests are counted by route *template* (`/v1/jobs/{job_id}`), never by raw path, so the number of
series stays bounded whatever clients send. The queue gauges are read from Redis when scraped
(`FleetCollector`), so every API replica reports the same fleet-wide values: aggregate them with
`max`, not `sum`.
"""

from __future__ import annotations

import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.keys import Heartbeat
from fleet.queue import Backlog
from toxfleet.contract import LATENCY_BUCKETS

UNMATCHED_ROUTE = "unmatched"
"""Route label of requests that matched no route (404s for unknown paths)."""

REQUESTS = Counter("toxfleet_http_requests", "HTTP requests answered, by route template, method and status.",
                   ["route", "method", "status"])
LATENCY = Histogram("toxfleet_http_request_duration_seconds",
                    "Seconds from request start to the end of the response (long-polls included).",
                    ["route", "method", "status"], buckets=LATENCY_BUCKETS)
JOBS = Counter("toxfleet_jobs_submitted", "Jobs accepted and enqueued (POST /v1/jobs and the drop-in endpoints).")
TEXTS = Counter("toxfleet_texts_submitted", "Texts in the jobs accepted.")
MESSAGES = Counter("toxfleet_messages_sent", "Task messages published (a job is split into chunks of 16 texts).")
LOOP_LAG = Gauge("toxfleet_api_loop_lag_seconds",
                 "How far this API process's event loop is behind (api.admission.LoopLag), read at scrape time; "
                 "over TOXFLEET_MAX_LOOP_LAG, new work gets 429 api-busy.")
CACHE_JOBS = Counter("toxfleet_cache_answered_jobs",
                     "Jobs whose texts were all in the score cache, answered by the API without a worker.")
CACHE_TEXTS = Counter("toxfleet_cache_answered_texts", "Texts in the jobs answered from the score cache alone.")


class MetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI: no body buffering, no extra task).

    Installed outermost, so it also sees requests refused before routing (413 for a large body);
    those are labelled with the route they would have matched among `routes`."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped to the server

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            # The router stores the matched route in the (shared) scope.
            route = getattr(scope.get("route"), "path", None) or self._match(scope)
            labels = (route, scope["method"], str(status))
            REQUESTS.labels(*labels).inc()
            LATENCY.labels(*labels).observe(time.perf_counter() - started)


    def _match(self, scope: Scope) -> str:
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return str(getattr(route, "path", UNMATCHED_ROUTE))
        return UNMATCHED_ROUTE


def count_submitted(texts: int, messages: int) -> None:
    JOBS.inc()
    TEXTS.inc(texts)
    MESSAGES.inc(messages)


def count_answered_from_cache(texts: int) -> None:
    CACHE_JOBS.inc()
    CACHE_TEXTS.inc(texts)


@dataclass(frozen=True)
class FleetReading:
    """What one scrape read from Redis: the backlog (None: Redis did not answer), the score cache's
    entries (None: not read, the cache is off here or its Redis did not answer) and the live workers'
    heartbeats (None: not read)."""

    backlog: Backlog | None
    cache_entries: int | None
    workers: list[Heartbeat] | None = None


UNREAD = FleetReading(None, None)

FLEET_GAUGES = {
    "toxfleet_queue_depth": "Task messages waiting in the Redis queue, read at scrape time.",
    "toxfleet_queue_unacked": "Task messages delivered to workers and not yet acknowledged (buffered or being scored).",
    "toxfleet_workers": "Workers whose heartbeat is recent.",
    "toxfleet_broker_up": "1 if Redis answered this scrape's queue read, else 0.",
    "toxfleet_cache_entries": "Scores in the score cache, read at scrape time (fleet-wide).",
    "toxfleet_worker_processes": "Pool processes of the workers whose heartbeat is recent (what the "
                                 "backpressure limit is per).",
}

FLEET_BACKENDS = "toxfleet_fleet_workers"
FLEET_BACKENDS_DOC = ("Workers whose heartbeat is recent, by the backend they run, the TOXFLEET_BACKEND "
                      "they were started with, and how that backend was chosen (name, gate, fallback; "
                      "`unknown` for a worker that does not say).")
FLEET_BACKENDS_LABELS = ["backend", "configured", "chosen_by"]
UNKNOWN = "unknown"


class FleetCollector(Collector):
    """The fleet-wide gauges, read by `read()` when Prometheus scrapes, so they are never stale.

    With Redis down the queue gauges are NaN, not their last values (a stale queue depth would look
    like a healthy one), and `toxfleet_broker_up` is 0."""

    def __init__(self, read: Callable[[], FleetReading]) -> None:
        self._read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Registering calls this, not collect(): no Redis read until the first scrape.
        yield from (GaugeMetricFamily(name, doc) for name, doc in FLEET_GAUGES.items())
        yield GaugeMetricFamily(FLEET_BACKENDS, FLEET_BACKENDS_DOC, labels=FLEET_BACKENDS_LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reading = self._read()
        backlog = reading.backlog
        values = {
            "toxfleet_queue_depth": math.nan if backlog is None else backlog.queued,
            "toxfleet_queue_unacked": math.nan if backlog is None else backlog.unacked,
            "toxfleet_workers": math.nan if backlog is None else backlog.workers,
            "toxfleet_broker_up": 0 if backlog is None else 1,
            "toxfleet_cache_entries": math.nan if reading.cache_entries is None else reading.cache_entries,
            "toxfleet_worker_processes": (math.nan if reading.workers is None
                                          else sum(w.concurrency for w in reading.workers)),
        }
        for name, doc in FLEET_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=values[name])
        # One series per (backend, configured, chosen_by) that runs now; with heartbeats unread, none.
        backends = GaugeMetricFamily(FLEET_BACKENDS, FLEET_BACKENDS_DOC, labels=FLEET_BACKENDS_LABELS)
        kinds = Tally((w.backend or UNKNOWN, w.configured or UNKNOWN, w.chosen_by) for w in reading.workers or [])
        for labels, count in sorted(kinds.items()):
            backends.add_metric(list(labels), count)
        yield backends
