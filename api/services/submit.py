"""Submit a job: a manifest key (`toxfleet:job:<id>`) plus one `toxfleet.score` task per chunk, whose
task ids derive from the job id. Around it: the Idempotency-Key (a retried submit returns the same
job), the score cache (a job whose texts are all cached is stored as succeeded, and no worker sees
it), backpressure (QueueFull past the fleet's share of work) and the pending record (from which the
sweeper re-sends a message Redis lost).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from celery import Celery
from redis.exceptions import RedisError

from api import metrics
from api.celery_client import Messages, Publisher
from api.coalescer import pipelined
from api.errors import BrokerUnavailable, IdempotencyMismatch, JobNotFound, NotReplicated, QueueFull
from api.services.fleet import FleetService
from api.services.manifests import ManifestCache
from api.settings import ApiSettings
from fleet import keys, logs, meta, pending
from fleet.cache import AsyncScoreCache, Scores, namespace
from toxfleet import contract
from toxfleet.thresholds import Thresholds

logger = logging.getLogger(__name__)


_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
"""Delete an Idempotency-Key record only if it still holds the value read (a concurrent submit may
already have replaced it with a record of its new job)."""


def new_job_id() -> str:
    return uuid.uuid4().hex


class Submitted(NamedTuple):
    job_id: str
    created: bool
    status: str = "queued"  # "succeeded" when the score cache answered every text


class SubmitService:
    """Enqueue jobs. One per process; cheap to share across requests."""

    def __init__(self, settings: ApiSettings, redis: aioredis.Redis, celery: Celery, fleet: FleetService,
                 cache: AsyncScoreCache | None = None, manifests: ManifestCache | None = None) -> None:
        self._settings = settings
        self._manifests = manifests or ManifestCache(ttl=0)
        self._redis = redis
        self._fleet = fleet
        self._cache = cache
        self._publisher = Publisher(celery)
        self._writes = pipelined(redis, transaction=True)
        self._result_key: Callable[[str], bytes] = celery.backend.get_key_for_task

    async def submit(self, texts: list[str], idempotency_key: str | None = None,
                     fingerprint: str = "", long_text: str = contract.TRUNCATE,
                     thresholds: Thresholds | None = None, owner: str | None = None,
                     priority: str = contract.INTERACTIVE, job_id: str | None = None) -> Submitted:
        """Enqueue a job; returns `(job_id, created, status)`. With an idempotency key seen before (and the
        same request `fingerprint`), returns the earlier job instead while it exists, `created` False. `owner` (the
        caller's key id, a hash, never the key) is stored with the job and scopes the idempotency key. A job whose
        texts are all in the score cache is stored as succeeded at once, and no worker sees it. `job_id`
        (one of `new_job_id`'s) is the id to give a new job, for a caller that watches it before it exists."""
        job_id = job_id or new_job_id()
        chunks = contract.chunk(texts, long_text=long_text)
        # The default mode sends no keyword at all: the message stays what every worker version reads.
        kwargs = {"long_text": long_text} if long_text != contract.TRUNCATE else None
        sent_at = time.time()  # the messages' publish time, also recorded with them as pending
        manifest_doc = {"chunks": [len(c) for c in chunks], "created": sent_at, "long_text": long_text,
                        "thresholds": (thresholds or self._settings.base_thresholds).to_json(),
                        **({"owner": owner} if owner else {})}
        manifest = json.dumps(manifest_doc)
        # Scoped per API key: another key's identical Idempotency-Key is another job.
        # Without keys it is the bare key, as before scoping (records written then stay valid).
        idem_key = None
        if idempotency_key:
            scoped = f"{owner}\n{idempotency_key}" if owner else idempotency_key
            idem_key = keys.IDEMPOTENCY_KEY_PREFIX + hashlib.sha256(scoped.encode()).hexdigest()
        try:
            earlier = await self._redis.get(idem_key) if idem_key else None
            if idem_key and earlier is not None and not await self._redis.exists(
                    keys.job_key(json.loads(earlier)["job_id"])):
                # Its job was deleted, or expired before the key did: the key is free, for a new job.
                await self._redis.eval(_RELEASE, 1, idem_key, earlier)
                earlier = None
            if earlier is not None:
                replayed = self._replay(earlier, fingerprint)
                await self._acknowledge()  # what an earlier attempt wrote may not be on a replica yet
                return Submitted(replayed, False)
            cached = await self._all_cached(texts, long_text)
            if cached is None:
                await self._check_backlog()
            def write(pipe: Any) -> None:
                pipe.set(keys.job_key(job_id), manifest, ex=self._settings.result_expires)
                if cached is not None:
                    self._store_cached(pipe, job_id, chunks, *cached)
                else:
                    # Recorded before the messages exist: a message Redis loses later is re-sent from here.
                    pending.record(pipe, {contract.chunk_task_id(job_id, i): ([c], kwargs)
                                          for i, c in enumerate(chunks)}, sent_at)

            await self._writes(write)  # in one MULTI/EXEC with the writes of concurrent submits
            self._manifests.put(job_id, manifest_doc)  # the reads that follow need not GET it back
            logs.bind_job(job_id)
            if idem_key:
                record = json.dumps({"job_id": job_id, "fingerprint": fingerprint})
                # The manifest exists before the key does, so whoever reads the key finds the job.
                if not await self._redis.set(idem_key, record, nx=True, ex=self._settings.idempotency_ttl):
                    await self._forget(job_id, len(chunks))  # a concurrent twin won; ours was never sent
                    replayed = self._replay(await self._redis.get(idem_key), fingerprint)
                    await self._acknowledge()
                    return Submitted(replayed, False)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if cached is not None:
            await self._acknowledge()
            metrics.count_submitted(len(texts), 0)
            metrics.count_answered_from_cache(len(texts))
            logs.bind_fields(texts=len(texts), messages=0)
            logger.debug("job %s answered from the score cache: texts=%d", job_id, len(texts))
            return Submitted(job_id, True, "succeeded")
        try:
            await self._publisher.send(Messages(job_id, chunks, kwargs, sent_at, contract.queue_for(priority)))
        except Exception as exc:  # kombu raises its own OperationalError family
            with contextlib.suppress(RedisError):
                await self._forget(job_id, len(chunks), *([idem_key] if idem_key else []))
            raise BrokerUnavailable(f"could not enqueue: {exc.__class__.__name__}") from exc
        self._fleet.count_sent(len(chunks))
        await self._acknowledge()
        metrics.count_submitted(len(texts), len(chunks))
        # Per job, so DEBUG (formatting it cost every job); the request's access line
        # carries the job id and these counts as fields instead (docs/observability.md).
        logs.bind_fields(texts=len(texts), messages=len(chunks))
        logger.debug("job %s submitted: texts=%d messages=%d", job_id, len(texts), len(chunks))
        return Submitted(job_id, True)

    async def _acknowledge(self) -> None:
        """With `submit_min_replicas`, wait until that many replicas hold everything written so far:
        Redis's `WAIT` counts the replicas that acknowledged this connection's last write, so one more
        write (a counter), made after the job's manifest, pending record and messages, goes first on
        the same connection (a pipeline). NotReplicated if fewer acknowledge in time: the job exists
        on the primary and may still run, and a retry with the same Idempotency-Key waits for it again."""
        wanted = self._settings.submit_min_replicas
        if not wanted:
            return
        timeout_ms = max(1, round(self._settings.submit_replica_timeout * 1000))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.incr(keys.SUBMIT_ACK_KEY)
                pipe.wait(wanted, timeout_ms)
                _, acknowledged = await pipe.execute()
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        if acknowledged < wanted:
            raise NotReplicated(f"{acknowledged} of {wanted} replicas acknowledged the job within "
                                f"{self._settings.submit_replica_timeout:g}s; retry with the same Idempotency-Key")

    async def delete(self, job_id: str, owner: str | None = None) -> None:
        """Forget a job (its manifest, results and pending records) and mark it deleted, so that
        workers skip its requests not yet scored; JobNotFound if absent or another key's."""
        try:
            raw = await self._redis.get(keys.job_key(job_id))
            manifest = json.loads(raw) if raw is not None else None
            if manifest is None or (owner is not None and manifest.get("owner") != owner):
                raise JobNotFound(f"no job {job_id} (unknown, deleted, or expired)")
            task_ids = [contract.chunk_task_id(job_id, i) for i in range(len(manifest["chunks"]))]
            async with self._redis.pipeline(transaction=True) as pipe:
                # The mark outlives any message of the job (they cannot wait longer than its results).
                pipe.set(keys.cancelled_key(job_id), "1", ex=self._settings.result_expires)
                pipe.delete(keys.job_key(job_id), *[self._result_key(t) for t in task_ids])
                pending.forget(pipe, task_ids)
                await pipe.execute()
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        self._manifests.forget(job_id)  # else a read in this process could still find it for a while
        logs.bind_job(job_id)
        logger.info("job %s deleted", job_id)

    async def _forget(self, job_id: str, chunks: int, *other_keys: str) -> None:
        """Undo a submit whose messages were never sent: its manifest, its pending record (else the
        sweeper would send what nobody asked for) and `other_keys`."""
        self._manifests.forget(job_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.job_key(job_id), *other_keys)
            pending.forget(pipe, [contract.chunk_task_id(job_id, i) for i in range(chunks)])
            await pipe.execute()

    async def _check_backlog(self) -> None:
        """QueueFull when the fleet already holds more work than it should: accepted jobs then keep
        a bounded wait (about backlog / fleet throughput) instead of an ever longer one."""
        # Prefetched by workers but not yet done counts: still waiting work.
        backlog = (await self._fleet.recent_backlog()).total
        processes = sum(w.concurrency for w in await self._fleet.recent_workers())
        limit = min(self._settings.max_queue_depth, self._settings.backlog_per_process * max(processes, 1))
        if backlog >= limit:
            raise QueueFull(f"queue is full: {backlog} messages waiting for {processes} worker processes "
                            f"(limit {limit}); retry later")

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

    async def _all_cached(self, texts: list[str], long_text: str) -> tuple[str, list[Scores]] | None:
        """`(model, scores)` when every text is in the score cache under the model and backend that
        all answering workers run (and only while all of them have the cache on), else None."""
        if self._cache is None:
            return None
        try:
            workers = await self._fleet.recent_workers()
            identities = {(w.model, w.backend) for w in workers}
            if len(identities) != 1 or not all(w.cache for w in workers):
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
            stored = meta.build(meta.SUCCESS, scores[offset: offset + len(texts)], task_id=task_id, date_done=now,
                                extra={"model": model, "cache_hits": len(texts)})
            pipe.set(self._result_key(task_id), json.dumps(stored), ex=self._settings.result_expires)
            offset += len(texts)
