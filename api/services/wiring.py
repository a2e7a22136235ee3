"""Build the services once per API process, over one shared Redis connection pool."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from api.celery_client import make_celery
from api.services.fleet import FleetService
from api.services.manifests import MANIFEST_TTL, ManifestCache
from api.services.read import ReadService
from api.services.submit import SubmitService
from api.settings import ApiSettings
from api.waiter import ResultWaiter
from fleet import redis_url as urls
from fleet.cache import AsyncScoreCache


@dataclass(frozen=True)
class Services:
    """Everything a request may need; held in `app.state.services`."""

    redis: aioredis.Redis
    submit: SubmitService
    read: ReadService
    fleet: FleetService
    waiter: ResultWaiter
    cache: AsyncScoreCache | None

    async def close(self) -> None:
        await self.waiter.close()
        await self.redis.aclose()
        if self.cache is not None and self.cache.client is not self.redis:
            await self.cache.client.aclose()


def make_services(settings: ApiSettings) -> Services:
    # A blocking pool: a burst of requests waits (up to redis_timeout) for a connection instead of failing.
    redis = urls.async_client(
        settings.redis_url, max_connections=settings.redis_max_connections, pool_timeout=settings.redis_timeout,
        socket_timeout=settings.redis_timeout, socket_connect_timeout=settings.redis_timeout)
    cache = None
    if settings.cache:
        client = redis if not settings.cache_url else urls.async_client(
            settings.cache_url, socket_timeout=settings.redis_timeout, socket_connect_timeout=settings.redis_timeout)
        cache = AsyncScoreCache(client)
    celery = make_celery(settings)
    # Celery publishes each result on a channel named after its key (the prefix includes any global
    # key prefix): the waiter watches them all.
    result_prefix = celery.backend.key_t(celery.backend.task_keyprefix)
    waiter = ResultWaiter(redis, settings.redis_timeout, result_prefix=result_prefix)
    fleet = FleetService(redis, cache)
    manifests = ManifestCache(ttl=min(MANIFEST_TTL, settings.result_expires))
    return Services(redis=redis, submit=SubmitService(settings, redis, celery, fleet, cache, manifests),
                    read=ReadService(settings, redis, celery.backend.get_key_for_task, waiter, manifests),
                    fleet=fleet, waiter=waiter, cache=cache)
