"""`GET /metrics`: Prometheus metrics of this API process, plus the queue read from Redis now."""

from __future__ import annotations

from fastapi import APIRouter, Response
from redis.exceptions import RedisError

from api import metrics
from api.deps import FleetDep

router = APIRouter(tags=["monitoring"])


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(fleet: FleetDep) -> Response:
    """Prometheus text format. Open (no API key), like /healthz: block it at the public load balancer."""
    try:
        metrics.set_queue(await fleet.backlog())
    except RedisError:
        metrics.set_broker_down()
    try:
        metrics.set_cache_entries(await fleet.cache_entries())
    except RedisError:  # the cache may live on its own Redis
        metrics.set_cache_entries(None)
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
