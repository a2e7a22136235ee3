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
from datetime import UTC, datetime
from typing import Any, cast

import redis.asyncio as aioredis
from celery import Celery
from celery.backends.redis import RedisBackend
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from api import metrics
from api.errors import BrokerUnavailable, IdempotencyMismatch, JobNotFound, QueueFull
from api.settings import ApiSettings
from api.waiter import RESYNC, ResultWaiter
from toxfleet import contract, logs
from toxfleet.cache import AsyncScoreCache, Scores, namespace
from toxfleet.celeryconf import celery_config
from toxfleet.thresholds import Thresholds

JOB_KEY_PREFIX = "toxfleet:job:"
"""Redis key prefix of job manifests."""

FLEET_TTL = 2.0
"""Seconds the API reuses its view of the live workers: their processes scale the backpressure limit,
and their model, backend and cache setting decide whether the score cache may answer a job."""

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
    flags: list[dict[str, Any]] | None = None
    cache_hits: int = 0

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed")


class SendOnlyRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend, minus the subscription it opens for every task sent.

    `send_task` subscribes the sender to the task's result channel so that `AsyncResult.get()` can
    wait on it, and unsubscribes when the result object is collected: two commands per message on a
    pub/sub connection per thread, whose confirmations nobody reads, and redis-py's PubSub keeps every
    channel name until it reads one, so memory grows with every job. The API never calls `.get()`; it
    reads result keys itself and waits with its own shared subscription (`api.waiter`)."""

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None


def make_celery(settings: ApiSettings) -> Celery:
    """A client-only Celery app: it sends tasks by name and never imports worker code."""
    # "<class>+<url>" is Celery's own syntax for a backend class with a URL.
    backend = f"{SendOnlyRedisBackend.__module__}:{SendOnlyRedisBackend.__qualname__}+{settings.redis_url}"
    app = Celery("toxfleet-api", broker=settings.redis_url, backend=backend, set_as_current=False)
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

    def __init__(self, settings: ApiSettings, redis: aioredis.Redis, celery: Celery,
                 cache: AsyncScoreCache | None = None) -> None:
        self._settings = settings
        self._redis = redis
        self._celery = celery
        self._cache = cache
        self._result_key = celery.backend.get_key_for_task
        self._waiter = ResultWaiter(redis, settings.redis_timeout)
        self._fleet_view: list[dict[str, Any]] = []
        self._fleet_at = -FLEET_TTL

    async def close(self) -> None:
        await self._waiter.close()
        await self._redis.aclose()
        if self._cache is not None and self._cache.client is not self._redis:
            await self._cache.client.aclose()

    # -- submit ---------------------------------------------------------------------------------

    async def submit(self, texts: list[str], idempotency_key: str | None = None,
                     fingerprint: str = "", long_text: str = contract.TRUNCATE,
                     thresholds: Thresholds | None = None) -> tuple[str, bool]:
        """Enqueue a job; returns `(job_id, created)`. With an idempotency key seen before (and the
        same request `fingerprint`), returns the earlier job instead, `created` False. A job whose
        texts are all in the score cache is stored as succeeded at once, and no worker sees it."""
        job_id = uuid.uuid4().hex
        chunks = contract.chunk(texts, long_text=long_text)
        # The default mode sends no keyword at all: the message stays what every worker version reads.
        kwargs = {"long_text": long_text} if long_text != contract.TRUNCATE else None
        sent_at = time.time()  # the messages' publish time, also recorded with them as pending
        manifest = json.dumps({"chunks": [len(c) for c in chunks], "created": sent_at, "long_text": long_text,
                               "thresholds": (thresholds or self._settings.base_thresholds).to_json()})
        manifest_key = JOB_KEY_PREFIX + job_id
        idem_key = IDEMPOTENCY_KEY_PREFIX + hashlib.sha256(idempotency_key.encode()).hexdigest() \
            if idempotency_key else None
        try:
            if idem_key and (earlier := await self._redis.get(idem_key)) is not None:
                return self._replay(earlier, fingerprint), False
            cached = await self._all_cached(texts, long_text)
            if cached is None:
                await self._check_backlog()
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(manifest_key, manifest, ex=self._settings.result_expires)
                if cached is not None:
                    self._store_cached(pipe, job_id, chunks, *cached)
                else:
                    # Recorded before the messages exist: a message Redis loses later is re-sent from here.
                    pending = {contract.chunk_task_id(job_id, i): json.dumps({"args": [c], "kwargs": kwargs})
                               for i, c in enumerate(chunks)}
                    pipe.zadd(contract.PENDING_KEY, dict.fromkeys(pending, sent_at))
                    pipe.hset(contract.PENDING_ARGS_KEY, mapping=cast(Any, pending))
                await pipe.execute()
            logs.bind_job(job_id)
            if idem_key:
                record = json.dumps({"job_id": job_id, "fingerprint": fingerprint})
                # The manifest exists before the key does, so whoever reads the key finds the job.
                if not await self._redis.set(idem_key, record, nx=True, ex=self._settings.idempotency_ttl):
                    await self._forget(job_id, len(chunks))  # a concurrent twin won; ours was never sent
                    return self._replay(await self._redis.get(idem_key), fingerprint), False
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if cached is not None:
            metrics.count_submitted(len(texts), 0)
            metrics.count_answered_from_cache(len(texts))
            logger.info("job %s answered from the score cache: texts=%d", job_id, len(texts),
                        extra={"texts": len(texts), "messages": 0})
            return job_id, True
        try:
            await run_in_threadpool(self._send, job_id, chunks, kwargs, sent_at)
        except Exception as exc:  # kombu raises its own OperationalError family
            with contextlib.suppress(RedisError):
                await self._forget(job_id, len(chunks), *([idem_key] if idem_key else []))
            raise BrokerUnavailable(f"could not enqueue: {exc.__class__.__name__}") from exc
        metrics.count_submitted(len(texts), len(chunks))
        logger.info("job %s submitted: texts=%d messages=%d", job_id, len(texts), len(chunks),
                    extra={"texts": len(texts), "messages": len(chunks)})
        return job_id, True

    async def _forget(self, job_id: str, chunks: int, *keys: str) -> None:
        """Undo a submit whose messages were never sent: its manifest, its pending record (else the
        sweeper would send what nobody asked for) and `keys`."""
        task_ids = [contract.chunk_task_id(job_id, i) for i in range(chunks)]
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(JOB_KEY_PREFIX + job_id, *keys)
            if task_ids:
                pipe.zrem(contract.PENDING_KEY, *task_ids)
                pipe.hdel(contract.PENDING_ARGS_KEY, *task_ids)
            await pipe.execute()

    async def _check_backlog(self) -> None:
        """QueueFull when the fleet already holds more work than it should: accepted jobs then keep
        a bounded wait (about backlog / fleet throughput) instead of an ever longer one."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.llen(contract.QUEUE)
            pipe.hlen(contract.UNACKED_KEY)  # prefetched by workers, not yet done: still waiting work
            depth, unacked = await pipe.execute()
        processes = sum(int(w.get("concurrency", 1)) for w in await self._fleet())
        limit = min(self._settings.max_queue_depth, self._settings.backlog_per_process * max(processes, 1))
        backlog = int(depth) + int(unacked)
        if backlog >= limit:
            raise QueueFull(f"queue is full: {backlog} messages waiting for {processes} worker processes "
                            f"(limit {limit}); retry later")

    async def _fleet(self) -> list[dict[str, Any]]:
        """The workers that answer, re-read at most every FLEET_TTL seconds: submits ask on every job."""
        now = time.monotonic()
        if now >= self._fleet_at + FLEET_TTL:
            self._fleet_view = await self.workers()
            self._fleet_at = now
        return self._fleet_view

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

    def _send(self, job_id: str, chunks: list[list[str]], kwargs: dict[str, str] | None, sent_at: float) -> None:
        headers = {contract.SENT_AT_HEADER: sent_at}  # workers measure queue wait from it
        with self._celery.producer_or_acquire() as producer:
            for i, texts in enumerate(chunks):
                self._celery.send_task(contract.SCORE_TASK, args=[texts], kwargs=kwargs,
                                       task_id=contract.chunk_task_id(job_id, i), producer=producer, headers=headers)

    async def _all_cached(self, texts: list[str], long_text: str) -> tuple[str, list[Scores]] | None:
        """`(model, scores)` when every text is in the score cache under the model and backend that
        all answering workers run (and only while all of them have the cache on), else None."""
        if self._cache is None:
            return None
        try:
            workers = await self._fleet()
            identities = {(w.get("model"), w.get("backend")) for w in workers}
            if len(identities) != 1 or not all(w.get("cache") for w in workers):
                return None  # no worker, a rollout in progress, or a worker without the cache
            model, backend = identities.pop()
            if not model or not backend:
                return None
            found = await self._cache.get(namespace(model, backend, long_text), texts)
            scores = [f for f in found if f is not None]
            if len(scores) < len(texts):
                return None  # the workers look up and count the hits of a partly cached job
            await self._cache.count_hits(len(scores))
        except RedisError as exc:
            # The cache may live on its own Redis: its absence must not fail a submit.
            logger.warning("score cache unavailable (%r); sending the job to the workers", exc)
            return None
        return str(model), scores

    def _store_cached(self, pipe: Any, job_id: str, chunks: list[list[str]], model: str,
                      scores: list[Scores]) -> None:
        """Store each chunk's result as a worker would (same keys, same meta), so that the job reads
        exactly like one a worker scored."""
        now = datetime.now(UTC).isoformat()
        offset = 0
        for i, texts in enumerate(chunks):
            task_id = contract.chunk_task_id(job_id, i)
            meta = {"status": "SUCCESS", "result": scores[offset: offset + len(texts)], "traceback": None,
                    "children": [], "date_done": now, "model": model, "cache_hits": len(texts), "task_id": task_id}
            pipe.set(self._result_key(task_id), json.dumps(meta), ex=self._settings.result_expires)
            offset += len(texts)

    # -- read -------------------------------------------------------------------------------------

    async def _manifest(self, job_id: str) -> dict[str, Any]:
        raw = await self._redis.get(JOB_KEY_PREFIX + job_id)
        if raw is None:
            raise JobNotFound(f"no job {job_id} (unknown, or expired after {self._settings.result_expires}s)")
        manifest: dict[str, Any] = json.loads(raw)
        return manifest

    def _view(self, job_id: str, manifest: dict[str, Any], metas: list[dict[str, Any] | None]) -> JobView:
        sizes: list[int] = manifest["chunks"]
        total = sum(sizes)
        statuses = [m.get("status") if m else None for m in metas]
        done = sum(n for n, s in zip(sizes, statuses, strict=True) if s == "SUCCESS")
        model = next((m.get("model") for m in metas if m and m.get("model")), None)
        hits = sum(int(m.get("cache_hits") or 0) for m, s in zip(metas, statuses, strict=True) if m and s == "SUCCESS")
        for i, (meta, status) in enumerate(zip(metas, statuses, strict=True)):
            if status == "FAILURE" and meta is not None:
                error = _error_text(meta.get("result"))
                where = f"chunk {i} of {len(sizes)}: " if len(sizes) > 1 else ""
                return JobView(job_id, "failed", total, done, None, model, where + error, cache_hits=hits)
        if all(s == "SUCCESS" for s in statuses):
            results = [r for m in metas if m for r in m["result"]]
            # Jobs stored before thresholds existed are flagged with the configured ones.
            thresholds = Thresholds.from_json(manifest["thresholds"]) if "thresholds" in manifest \
                else self._settings.base_thresholds
            flags = [thresholds.flags(r) for r in results]
            return JobView(job_id, "succeeded", total, done, results, model, None, flags, hits)
        status = "running" if any(s is not None for s in statuses) else "queued"
        return JobView(job_id, status, total, done, None, model, None, cache_hits=hits)

    async def get(self, job_id: str, wait: float = 0.0) -> JobView:
        """The job now, or once finished if that happens within `wait` seconds."""
        logs.bind_job(job_id)
        try:
            manifest = await self._manifest(job_id)
            keys = [self._result_key(contract.chunk_task_id(job_id, i)) for i in range(len(manifest["chunks"]))]
            if wait <= 0:
                view = self._view(job_id, manifest, await self._metas(keys))
            else:
                view = await self._wait(job_id, manifest, keys, wait)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if view.finished:
            # Logged on each read of a finished job: the API learns that a job finished only when asked.
            fields = {"status": view.status, "texts": view.total, **({"error": view.error} if view.error else {})}
            logger.info("job %s %s: texts=%d", job_id, view.status, view.total, extra=fields)
        return view

    async def _metas(self, keys: list[bytes]) -> list[dict[str, Any] | None]:
        return [json.loads(v) if v is not None else None for v in await self._redis.mget(keys)]

    async def _wait(self, job_id: str, manifest: dict[str, Any], keys: list[bytes], wait: float) -> JobView:
        deadline = time.monotonic() + wait
        async with self._waiter.watching(keys) as queue:
            # Subscribed (confirmed), then read: a result stored in between is seen by one or the other.
            metas = await self._metas(keys)
            index = {k: i for i, k in enumerate(keys)}
            view = self._view(job_id, manifest, metas)
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
                view = self._view(job_id, manifest, metas)
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

    async def cache_entries(self) -> int | None:
        """Entries in the score cache now (None when the cache is off here)."""
        return await self._cache.entries() if self._cache is not None else None

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
    cache = None
    if settings.cache:
        client = redis if not settings.cache_url else aioredis.Redis.from_url(
            settings.cache_url, socket_timeout=settings.redis_timeout, socket_connect_timeout=settings.redis_timeout)
        cache = AsyncScoreCache(client)
    return JobService(settings, redis, make_celery(settings), cache)

