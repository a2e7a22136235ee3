"""Prometheus metrics of the HTTP tier, served at `GET /metrics` (see docs/observability.md).

Requests are counted by route *template* (`/v1/jobs/{job_id}`), never by raw path, so the number of
series stays bounded whatever clients send. The queue gauges are read from Redis when scraped
(asynchronously, one pipelined round trip), so every API replica reports the same fleet-wide values:
aggregate them with `max`, not `sum`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from toxfleet.contract import LATENCY_BUCKETS
from toxfleet.queue import Backlog

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
QUEUE_DEPTH = Gauge("toxfleet_queue_depth", "Task messages waiting in the Redis queue, read at scrape time.")
QUEUE_UNACKED = Gauge("toxfleet_queue_unacked",
                      "Task messages delivered to workers and not yet acknowledged (buffered or being scored).")
WORKERS = Gauge("toxfleet_workers", "Workers whose heartbeat is recent.")
CACHE_JOBS = Counter("toxfleet_cache_answered_jobs",
                     "Jobs whose texts were all in the score cache, answered by the API without a worker.")
CACHE_TEXTS = Counter("toxfleet_cache_answered_texts", "Texts in the jobs answered from the score cache alone.")
CACHE_ENTRIES = Gauge("toxfleet_cache_entries", "Scores in the score cache, read at scrape time (fleet-wide).")
BROKER_UP = Gauge("toxfleet_broker_up", "1 if Redis answered the last scrape's queue read, else 0.")


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


def set_cache_entries(entries: int | None) -> None:
    CACHE_ENTRIES.set(float("nan") if entries is None else entries)


def set_queue(backlog: Backlog) -> None:
    QUEUE_DEPTH.set(backlog.queued)
    QUEUE_UNACKED.set(backlog.unacked)
    WORKERS.set(backlog.workers)
    BROKER_UP.set(1)


def set_broker_down() -> None:
    # NaN, not the last value: a stale queue depth would look like a healthy one.
    for gauge in (QUEUE_DEPTH, QUEUE_UNACKED, WORKERS):
        gauge.set(float("nan"))
    BROKER_UP.set(0)


def exposition() -> tuple[bytes, str]:
    """The registry in Prometheus' text format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
