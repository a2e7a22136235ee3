"""The workers' autoscaling signal: backlog per worker task, as CloudWatch metrics on stdout.

    python -m tools.backlog [--interval 60] [--service toxfleet-worker] [--once]

ECS has no metric for a Redis queue, so this publishes one. Every `--interval` seconds it reads the
messages waiting in the queue and the messages delivered to workers and not yet acknowledged (late
acks: buffered or being scored) in one round trip; then the workers whose heartbeat is recent (and how
many of them run the reference for want of a fidelity decision: `FallbackWorkers`); then it takes the
job latency samples the workers recorded since (`JobLatency`, seconds from the API's publish to the
result stored, per task message: `fleet.latency`). It prints a CloudWatch Embedded Metric Format (EMF)
line (more lines when there are over EMF_MAX_VALUES samples): the `awslogs` log driver ships it to
CloudWatch Logs, which extracts the metrics itself, so this needs no AWS SDK and no credentials
beyond the task's log permissions. No torch, no Celery: Redis only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import redis

from fleet import latency, logs
from fleet import redis_url as urls
from fleet.keys import DEFAULT_REDIS_URL
from fleet.queue import Backlog, read_alive_workers, read_backlog

logger = logging.getLogger(__name__)

NAMESPACE = "toxfleet"
"""CloudWatch namespace of the metrics."""

DEFAULT_INTERVAL = 60.0
"""Seconds between two readings (CloudWatch's standard resolution is one minute)."""

DEFAULT_SERVICE = "toxfleet-worker"
"""Value of the `Service` dimension; the scaling policy's metric must name the same."""

EMF_MAX_VALUES = 100
"""Values one EMF metric may carry (CloudWatch's limit); more job latency samples go in further lines."""

LATENCY_UNITS = {"JobLatency": "Seconds"}
"""EMF units of the metrics that are not counts."""

__all__ = ["DEFAULT_INTERVAL", "DEFAULT_SERVICE", "EMF_MAX_VALUES", "NAMESPACE", "Backlog", "emf", "latency_emf",
           "main", "publish"]


def _document(service: str, timestamp: float, values: dict[str, Any], units: dict[str, str]) -> dict[str, Any]:
    return {
        "_aws": {
            "Timestamp": int(timestamp * 1000),
            "CloudWatchMetrics": [{
                "Namespace": NAMESPACE,
                "Dimensions": [["Service"]],
                "Metrics": [{"Name": name, "Unit": units.get(name, "Count")} for name in values],
            }],
        },
        "Service": service,
        **values,
    }


def emf(backlog: Backlog, service: str, timestamp: float, fallback: int = 0,
        latencies: Sequence[float] = ()) -> dict[str, Any]:
    """One EMF document: the `_aws` metadata names the metrics, the root members hold the values.
    `fallback`: live workers configured `auto` that run the reference with no decision behind it;
    `latencies`: at most EMF_MAX_VALUES job latency samples (seconds), JobLatency only if there are any."""
    values: dict[str, Any] = {"BacklogPerTask": backlog.per_task, "Backlog": backlog.total,
                              "QueueDepth": backlog.queued, "Unacked": backlog.unacked,
                              "Workers": backlog.workers, "FallbackWorkers": fallback}
    if latencies:
        values["JobLatency"] = list(latencies)
    return _document(service, timestamp, values, LATENCY_UNITS)


def latency_emf(service: str, timestamp: float, latencies: Sequence[float]) -> dict[str, Any]:
    """An EMF document of JobLatency samples alone: the ones beyond the first document's EMF_MAX_VALUES."""
    return _document(service, timestamp, {"JobLatency": list(latencies)}, LATENCY_UNITS)


def publish(client: redis.Redis, service: str, out: TextIO) -> Backlog:
    backlog = read_backlog(client)
    fallback = sum(beat.chosen_by == "fallback" for beat in read_alive_workers(client))
    # Drained last: a Redis error before it leaves the samples for the next reading.
    samples = latency.drain(client)
    now = time.time()
    docs = [emf(backlog, service, now, fallback, samples[:EMF_MAX_VALUES])]
    docs += [latency_emf(service, now, samples[i:i + EMF_MAX_VALUES])
             for i in range(EMF_MAX_VALUES, len(samples), EMF_MAX_VALUES)]
    out.write("".join(json.dumps(d, separators=(",", ":")) + "\n" for d in docs))
    out.flush()
    return backlog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.backlog", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="broker URL (default: $REDIS_URL)")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL, help="seconds between readings")
    parser.add_argument("--service", default=DEFAULT_SERVICE, help="value of the Service dimension")
    parser.add_argument("--once", action="store_true", help="print one reading and exit")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be positive")
    logs.configure("json" if os.environ.get("TOXFLEET_LOG_FORMAT") == "json" else "text")
    client = urls.sync_client(args.redis_url, socket_timeout=5, socket_connect_timeout=5)
    if args.once:
        publish(client, args.service, sys.stdout)
        return 0
    while True:
        started = time.monotonic()
        try:
            publish(client, args.service, sys.stdout)
        except redis.RedisError as exc:
            # No data point rather than a wrong one (a zero would scale the workers in).
            logger.warning("backlog: cannot read Redis (%r); no data point this time", exc)
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


if __name__ == "__main__":
    raise SystemExit(main())
