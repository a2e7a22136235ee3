"""Jobs: submit texts as Celery task messages (by name), read and await their results from Redis.

A job is a manifest key (`toxfleet:job:<id>`) plus one `toxfleet.score` task per chunk, whose task
ids derive from the job id, so reading a job is one GET and one MGET, whatever its size. Waiting
subscribes to the result keys' pub/sub channels (Celery's Redis backend publishes every result it
stores), so a long-poll answers the moment the last chunk lands, with no polling loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from celery import Celery
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from api import metrics
from api.errors import BrokerUnavailable, IdempotencyMismatch, JobNotFound, QueueFull
from api.settings import ApiSettings
from api.waiter import RESYNC, ResultWaiter
from toxfleet import contract, logs
from toxfleet.celeryconf import celery_config

JOB_KEY_PREFIX = "toxfleet:job:"
"""Redis key prefix of job manifests."""

RECHECK_SECONDS = 1.0
"""A long-poll also re-reads its job this often, a safety net under the pub/sub wake-ups."""

IDEMPOTENCY_KEY_PREFIX = "toxfleet:idem:"
"""Redis key prefix of Idempotency-Key records (the client's key is stored hashed)."""

_FINAL = {"SUCCESS", "FAILURE"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobView:
    """A job as the API reports it."""

    id: str
    status: str  # queued | running | succeeded | failed
    total: int
    done: int
    results: list[dict[str, float]] | None
    model: str | None
    error: str | None

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed")


def make_celery(settings: ApiSettings) -> Celery:
    """A client-only Celery app: it sends tasks by name and never imports worker code."""
    app = Celery("toxfleet-api", broker=settings.redis_url, backend=settings.redis_url, set_as_current=False)
    app.conf.update(
        celery_config(visibility_timeout=settings.visibility_timeout, result_expires=settings.result_expires),
        # Fail fast when Redis is away: the client gets a 503 and retries, instead of a hung request.
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
        broker_connection_timeout=settings.redis_timeout,
        broker_connection_max_retries=1,
    )
    return app


def _error_text(result: Any) -> str:
    if isinstance(result, dict) and "exc_type" in result:
        return f"{result['exc_type']}: {result.get('exc_message', '')}".strip()
    return str(result)


class JobService:
    """Submit, read and await jobs. One per process; cheap to share across requests."""

    def __init__(self, settings: ApiSettings, redis: aioredis.Redis, celery: Celery) -> None:
        self._settings = settings
        self._redis = redis
        self._celery = celery
        self._result_key = celery.backend.get_key_for_task
        self._waiter = ResultWaiter(redis, settings.redis_timeout)

    async def close(self) -> None:
        await self._waiter.close()
        await self._redis.aclose()

    # -- submit ---------------------------------------------------------------------------------

    async def submit(self, texts: list[str], idempotency_key: str | None = None,
                     fingerprint: str = "") -> tuple[str, bool]:
        """Enqueue a job; returns `(job_id, created)`. With an idempotency key seen before (and the
        same request `fingerprint`), returns the earlier job instead, `created` False."""
        job_id = uuid.uuid4().hex
        chunks = contract.chunk(texts)
        manifest_key = JOB_KEY_PREFIX + job_id
        idem_key = IDEMPOTENCY_KEY_PREFIX + hashlib.sha256(idempotency_key.encode()).hexdigest() \
            if idempotency_key else None
        try:
            if idem_key and (earlier := await self._redis.get(idem_key)) is not None:
                return self._replay(earlier, fingerprint), False
            depth = await self._redis.llen(contract.QUEUE)
            if depth >= self._settings.max_queue_depth:
                raise QueueFull(f"queue is full ({depth} messages waiting); retry later")
            manifest = json.dumps({"chunks": [len(c) for c in chunks], "created": time.time()})
            await self._redis.set(manifest_key, manifest, ex=self._settings.result_expires)
            logs.bind_job(job_id)
            if idem_key:
                record = json.dumps({"job_id": job_id, "fingerprint": fingerprint})
                # The manifest exists before the key does, so whoever reads the key finds the job.
                if not await self._redis.set(idem_key, record, nx=True, ex=self._settings.idempotency_ttl):
                    await self._redis.delete(manifest_key)  # a concurrent twin won; ours was never sent
                    return self._replay(await self._redis.get(idem_key), fingerprint), False
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        try:
            await run_in_threadpool(self._send, job_id, chunks)
        except Exception as exc:  # kombu raises its own OperationalError family
            with contextlib.suppress(RedisError):
                await self._redis.delete(manifest_key, *([idem_key] if idem_key else []))
            raise BrokerUnavailable(f"could not enqueue: {exc.__class__.__name__}") from exc
        metrics.count_submitted(len(texts), len(chunks))
        logger.info("job %s submitted: texts=%d messages=%d", job_id, len(texts), len(chunks),
                    extra={"texts": len(texts), "messages": len(chunks)})
        return job_id, True

    @staticmethod
    def _replay(record: bytes | str | None, fingerprint: str) -> str:
        if record is None:  # expired between two reads: vanishingly rare; the client retries
            raise BrokerUnavailable("idempotency record changed during the request; retry")
        earlier = json.loads(record)
        if earlier["fingerprint"] != fingerprint:
            raise IdempotencyMismatch("Idempotency-Key was already used with a different request body")
        job_id: str = earlier["job_id"]
        logs.bind_job(job_id)
        logger.info("job %s replayed for a repeated Idempotency-Key", job_id)
        return job_id

    async def incr_window(self, key: str) -> int:
        """Count a request in a rate-limit window key (expires with the window)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, 2)
            count, _ = await pipe.execute()
        return int(count)

    def _send(self, job_id: str, chunks: list[list[str]]) -> None:
        headers = {contract.SENT_AT_HEADER: time.time()}  # workers measure queue wait from it
        with self._celery.producer_or_acquire() as producer:
            for i, texts in enumerate(chunks):
                self._celery.send_task(contract.SCORE_TASK, args=[texts], task_id=contract.chunk_task_id(job_id, i),
                                       producer=producer, headers=headers)

    # -- read -------------------------------------------------------------------------------------

    async def _manifest(self, job_id: str) -> list[int]:
        raw = await self._redis.get(JOB_KEY_PREFIX + job_id)
        if raw is None:
            raise JobNotFound(f"no job {job_id} (unknown, or expired after {self._settings.result_expires}s)")
        sizes: list[int] = json.loads(raw)["chunks"]
        return sizes

    def _view(self, job_id: str, sizes: list[int], metas: list[dict[str, Any] | None]) -> JobView:
        total = sum(sizes)
        statuses = [m.get("status") if m else None for m in metas]
        done = sum(n for n, s in zip(sizes, statuses, strict=True) if s == "SUCCESS")
        model = next((m.get("model") for m in metas if m and m.get("model")), None)
        for i, (meta, status) in enumerate(zip(metas, statuses, strict=True)):
            if status == "FAILURE" and meta is not None:
                error = _error_text(meta.get("result"))
                where = f"chunk {i} of {len(sizes)}: " if len(sizes) > 1 else ""
                return JobView(job_id, "failed", total, done, None, model, where + error)
        if all(s == "SUCCESS" for s in statuses):
            results = [r for m in metas if m for r in m["result"]]
            return JobView(job_id, "succeeded", total, done, results, model, None)
        status = "running" if any(s is not None for s in statuses) else "queued"
        return JobView(job_id, status, total, done, None, model, None)

    async def get(self, job_id: str, wait: float = 0.0) -> JobView:
        """The job now, or once finished if that happens within `wait` seconds."""
        logs.bind_job(job_id)
        try:
            sizes = await self._manifest(job_id)
            keys = [self._result_key(contract.chunk_task_id(job_id, i)) for i in range(len(sizes))]
            if wait <= 0:
                view = self._view(job_id, sizes, await self._metas(keys))
            else:
                view = await self._wait(job_id, sizes, keys, wait)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if view.finished:
            # Logged on each read of a finished job: the API learns that a job finished only when asked.
            fields = {"status": view.status, "texts": view.total, **({"error": view.error} if view.error else {})}
            logger.info("job %s %s: texts=%d", job_id, view.status, view.total, extra=fields)
        return view

    async def _metas(self, keys: list[bytes]) -> list[dict[str, Any] | None]:
        return [json.loads(v) if v is not None else None for v in await self._redis.mget(keys)]

    async def _wait(self, job_id: str, sizes: list[int], keys: list[bytes], wait: float) -> JobView:
        deadline = time.monotonic() + wait
        async with self._waiter.watching(keys) as queue:
            # Subscribed (confirmed), then read: a result stored in between is seen by one or the other.
            metas = await self._metas(keys)
            index = {k: i for i, k in enumerate(keys)}
            view = self._view(job_id, sizes, metas)
            while not view.finished and (remaining := deadline - time.monotonic()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), min(remaining, RECHECK_SECONDS))
                except TimeoutError:
                    item = RESYNC
                if item is RESYNC:
                    metas = await self._metas(keys)
                else:
                    key, value = item
                    metas[index[key]] = json.loads(value)
                view = self._view(job_id, sizes, metas)
            return view

    async def queue_depth(self) -> int:
        depth: int = await self._redis.llen(contract.QUEUE)
        return depth

    async def queue_stats(self) -> tuple[int, int, int]:
        """Messages waiting, messages delivered but unacknowledged, and answering workers (one round trip)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.llen(contract.QUEUE)
            pipe.hlen(contract.UNACKED_KEY)
            pipe.zcount(contract.WORKERS_KEY, time.time() - contract.HEARTBEAT_STALE_SECONDS, "+inf")
            depth, unacked, workers = await pipe.execute()
        return int(depth), int(unacked), int(workers)

    async def workers(self) -> list[dict[str, Any]]:
        """Workers whose heartbeat is recent, with what they run."""
        now = time.time()
        names = await self._redis.zrangebyscore(contract.WORKERS_KEY, now - contract.HEARTBEAT_STALE_SECONDS, "+inf")
        if not names:
            return []
        prefix = contract.WORKER_INFO_PREFIX.encode()
        infos = await self._redis.mget([prefix + n for n in names if isinstance(n, bytes)])
        return [json.loads(i) for i in infos if i is not None]

    async def ping(self) -> None:
        await self._redis.ping()


def make_service(settings: ApiSettings) -> JobService:
    # A blocking pool: a burst of requests waits (up to redis_timeout) for a connection instead of failing.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections, timeout=settings.redis_timeout,
        socket_timeout=settings.redis_timeout, socket_connect_timeout=settings.redis_timeout)
    redis = aioredis.Redis(connection_pool=pool)
    return JobService(settings, redis, make_celery(settings))

