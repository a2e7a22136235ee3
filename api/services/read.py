"""Read a job, or await it: one GET (the manifest) and one MGET (its chunks' result metas), whatever
its size. Waiting subscribes to the result keys' pub/sub channels (Celery's Redis backend publishes
every result it stores), so a long-poll answers the moment the last chunk lands, with no polling loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from api.coalescer import pipelined
from api.errors import BrokerUnavailable, JobNotFound
from api.schemas import Job, Progress
from api.services.manifests import ManifestCache
from api.settings import ApiSettings
from api.waiter import RESYNC, Queue, ResultWaiter
from fleet import keys, logs, meta
from fleet.meta import Meta
from toxfleet import contract
from toxfleet.contract import JobState
from toxfleet.thresholds import Thresholds

RECHECK_SECONDS = 1.0
"""A long-poll also re-reads its job this often, a safety net under the pub/sub wake-ups."""

logger = logging.getLogger(__name__)


def parse_time(iso: str) -> float:
    """Unix time of an ISO 8601 date (Celery's `date_done`; naive ones are UTC)."""
    moment = datetime.fromisoformat(iso)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def rfc3339(unix: float) -> str:
    """`2026-01-31T12:00:00.123Z`."""
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


Finished = Callable[[float, str | None, bool], Awaitable[Job]]
"""`await finished(wait, owner, sent)`: the job `ReadService.expecting` watches, once finished or
after `wait` seconds."""


class ReadService:
    """Job views and long-polls. One per process; cheap to share across requests."""

    def __init__(self, settings: ApiSettings, redis: aioredis.Redis, result_key: Callable[[str], bytes],
                 waiter: ResultWaiter, manifests: ManifestCache | None = None) -> None:
        self._settings = settings
        self._manifests = manifests or ManifestCache(ttl=0)
        self._redis = redis
        self._result_key = result_key
        self._waiter = waiter
        self._reads = pipelined(redis, transaction=False)

    async def get(self, job_id: str, wait: float = 0.0, owner: str | None = None) -> Job:
        """The job now, or once finished if that happens within `wait` seconds; with `owner` (the
        caller's key id), JobNotFound unless that key created the job."""
        logs.bind_job(job_id)
        try:
            manifest, remembered = await self._manifest_of(job_id, owner)
            result_keys = self._keys(job_id, len(manifest["chunks"]))
            # A manifest from memory is confirmed in the results' round trip: a job Redis lost since
            # (restarted empty, failed over) is a 404 at once, never `queued` with no results.
            confirm = job_id if remembered else None
            if wait <= 0:
                view = self._view(job_id, manifest, await self._metas(result_keys, confirm))
            else:
                async with self._waiter.watching(result_keys) as queue:
                    # Subscribed (confirmed), then read: a result stored in between is seen by one or the other.
                    metas = await self._metas(result_keys, confirm)
                    view = await self._wait(job_id, manifest, result_keys, queue, metas, wait)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc
        return self._reported(view)

    @contextlib.asynccontextmanager
    async def expecting(self, job_id: str, chunks: int) -> AsyncIterator[Finished]:
        """Watch the results of a job not submitted yet, `chunks` messages long: submit it inside the
        block (`SubmitService.submit(job_id=...)`), then `await finished(wait, owner, sent)`. With
        `sent` (the submit sent its messages), nothing of the job can have been stored before the
        watch began, so the wait starts without reading the results: the compatibility endpoints'
        one read per request fewer (`get` must read them: its job may have finished before its
        watch began). Without it (the score cache answered the submit) they are read first."""
        result_keys = self._keys(job_id, chunks)

        async def finished(wait: float, owner: str | None, sent: bool) -> Job:
            logs.bind_job(job_id)
            manifest = await self._manifest(job_id, owner)
            metas: list[Meta | None] = [None] * chunks if sent else await self._metas(result_keys)
            return self._reported(await self._wait(job_id, manifest, result_keys, queue, metas, wait))

        try:
            async with self._waiter.watching(result_keys) as queue:
                yield finished
        # The subscription's, and those of the block's `finished`, which runs inside the watch.
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {exc.__class__.__name__}") from exc

    def _keys(self, job_id: str, chunks: int) -> list[bytes]:
        return [self._result_key(contract.chunk_task_id(job_id, i)) for i in range(chunks)]

    def _reported(self, view: Job) -> Job:
        job_id = view.id
        if view.finished:
            # On each read of a finished job (the API learns that a job finished only when asked): the
            # request's access line carries the outcome; a failure also gets a line, with its error.
            total = view.progress.total
            logs.bind_fields(job_status=view.status, texts=total)
            if view.error:
                logger.info("job %s %s: texts=%d", job_id, view.status, total,
                            extra={"status": view.status, "texts": total, "error": view.error})
            else:
                logger.debug("job %s %s: texts=%d", job_id, view.status, total)
        return view

    async def _manifest(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        return (await self._manifest_of(job_id, owner))[0]

    async def _manifest_of(self, job_id: str, owner: str | None = None) -> tuple[dict[str, Any], bool]:
        """The job's manifest, and whether it came from memory (not read from Redis just now)."""
        # A manifest this process wrote a moment ago (a long-poll right after its submit) needs no GET.
        manifest: dict[str, Any] | None = self._manifests.get(job_id)
        remembered = manifest is not None
        if manifest is None:
            raw = await self._redis.get(keys.job_key(job_id))
            manifest = json.loads(raw) if raw is not None else None
        # Another key's job is answered exactly like a missing one: its existence is not disclosed.
        if manifest is None or (owner is not None and manifest.get("owner") != owner):
            raise self._not_found(job_id)
        return manifest, remembered

    def _not_found(self, job_id: str) -> JobNotFound:
        return JobNotFound(f"no job {job_id} (unknown, deleted, or expired after {self._settings.result_expires}s)")

    def _view(self, job_id: str, manifest: dict[str, Any], metas: list[Meta | None]) -> Job:
        view = self._state(job_id, manifest, metas)
        created = manifest.get("created")
        started = [t for m in metas if m for t in [m.started_at or (m.date_done if m.final else None)] if t]
        finished = [m.date_done for m in metas if m and m.final and m.date_done]
        return view.model_copy(update={
            "created_at": rfc3339(created) if created else None,
            "expires_at": rfc3339(created + self._settings.result_expires) if created else None,
            "started_at": rfc3339(min(map(parse_time, started))) if started else None,
            "finished_at": rfc3339(max(map(parse_time, finished))) if view.finished and finished else None})

    def _state(self, job_id: str, manifest: dict[str, Any], metas: list[Meta | None]) -> Job:
        sizes: list[int] = manifest["chunks"]
        total = sum(sizes)
        statuses = [m.status if m else None for m in metas]
        done = sum(n for n, s in zip(sizes, statuses, strict=True) if s == meta.SUCCESS)
        progress = Progress(done=done, total=total)
        model = next((m.model for m in metas if m and m.model), None)
        hits = sum(m.cache_hits for m, s in zip(metas, statuses, strict=True) if m and s == meta.SUCCESS)
        for i, (m, status) in enumerate(zip(metas, statuses, strict=True)):
            if status == meta.FAILURE and m is not None:
                where = f"chunk {i} of {len(sizes)}: " if len(sizes) > 1 else ""
                return Job(id=job_id, status="failed", progress=progress, results=None, model=model,
                           error=where + m.error, cache_hits=hits)
        if all(s == meta.SUCCESS for s in statuses):
            results = [r for m in metas if m for r in m.result]
            # Jobs stored before thresholds existed are flagged with the configured ones.
            thresholds = Thresholds.from_json(manifest["thresholds"]) if "thresholds" in manifest \
                else self._settings.base_thresholds
            flags = [thresholds.flags(r) for r in results]
            return Job(id=job_id, status="succeeded", progress=progress, results=results, model=model, error=None,
                       flags=flags, cache_hits=hits)  # type: ignore[arg-type]  # flags: validated into Flags
        state: JobState = "running" if any(s is not None for s in statuses) else "queued"
        return Job(id=job_id, status=state, progress=progress, results=None, model=model, error=None,
                   cache_hits=hits)

    async def _metas(self, result_keys: list[bytes], confirm: str | None = None) -> list[Meta | None]:
        """The results; with `confirm` (a job id), JobNotFound unless that job still exists, read in the
        same round trip."""
        def read(pipe: Any) -> None:
            if confirm is not None:
                pipe.exists(keys.job_key(confirm))
            pipe.mget(result_keys)

        # One MGET (and EXISTS) in a pipeline shared with the reads of concurrent requests (api.coalescer).
        *exists, values = await self._reads(read)
        if confirm is not None and not exists[0]:
            raise self._not_found(confirm)
        return [meta.parse(v) for v in values]

    async def _recheck(self, job_id: str, result_keys: list[bytes]) -> list[Meta | None]:
        """The results again, in the same round trip as whether the job still exists: a manifest from
        memory, or one read before Redis lost its data or the job was deleted, must not hold a
        long-poll for results that will never come (the client resubmits a job once it is a 404).
        The same coalesced read as `get`'s confirmed one (`_metas`)."""
        return await self._metas(result_keys, job_id)

    async def _wait(self, job_id: str, manifest: dict[str, Any], result_keys: list[bytes], queue: Queue,
                    metas: list[Meta | None], wait: float) -> Job:
        """From `metas` (the results as of when `queue` began to watch them) until the job is finished
        or `wait` seconds have passed."""
        deadline = time.monotonic() + wait
        index = {k: i for i, k in enumerate(result_keys)}
        view = self._view(job_id, manifest, metas)
        while not view.finished and (remaining := deadline - time.monotonic()) > 0:
            try:
                # Not `wait_for`: on 3.11 it wraps the get in a task of its own, per wake-up.
                async with asyncio.timeout(min(remaining, RECHECK_SECONDS)):
                    item = await queue.get()
            except TimeoutError:
                item = RESYNC
            if item is RESYNC:
                metas = await self._recheck(job_id, result_keys)
            else:
                key, value = item
                metas[index[key]] = meta.parse(value)
            view = self._view(job_id, manifest, metas)
        return view
