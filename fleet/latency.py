"""Job latency samples for CloudWatch: seconds from the API publishing a task message to a worker
storing its final result, pushed by the workers in the round trip that stores the results and drained
by the backlog publisher (`tools.backlog`) each minute, which CloudWatch's JobLatencyP99Alarm reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from fleet.keys import JOB_LATENCY_KEY

MAX_SAMPLES = 10_000
"""The newest samples kept between two drains: bounds the list where no publisher runs (`make run`)."""

SAMPLES_TTL = 3600
"""Seconds the list outlives its last push, for the same reason."""


def record(pipe: Any, seconds: Sequence[float]) -> None:
    """Queue a push of these samples on a pipeline (sync or asyncio), capped to the newest MAX_SAMPLES."""
    if seconds:
        pipe.rpush(JOB_LATENCY_KEY, *(f"{s:.3f}" for s in seconds))
        pipe.ltrim(JOB_LATENCY_KEY, -MAX_SAMPLES, -1)
        pipe.expire(JOB_LATENCY_KEY, SAMPLES_TTL)


def drain(client: redis.Redis) -> list[float]:
    """Take every sample recorded since the last drain, atomically (MULTI): none read twice or lost."""
    with client.pipeline(transaction=True) as pipe:
        pipe.lrange(JOB_LATENCY_KEY, 0, -1)
        pipe.delete(JOB_LATENCY_KEY)
        raw, _ = pipe.execute()
    return [float(v) for v in raw]
