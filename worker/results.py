"""Write a whole batch's outcomes to Celery's Redis result backend in one round trip.

`backend.mark_as_done` costs a round trip per request; a batch of 40 requests would pay 40. This
writes the same keys, the same JSON meta and the same pub/sub notification Celery's Redis backend
does (so `AsyncResult.get()` and the API's long-poll both see it), in one pipeline. The meta
carries extra fields Celery ignores: `model`, `batch` and `cache_hits`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fleet import latency, meta, pending
from fleet.keys import cancelled_key, lease_key
from toxfleet.contract import job_of

logger = logging.getLogger(__name__)

# Shared by the scripts below: whether a result key holds a final meta ("final" is
# `fleet.meta.FINAL_STATES`, spelt out in Lua), and a write with the results' expiry (0: none).
_LUA_HELPERS = """
local function is_final(key)
  local value = redis.call('GET', key)
  if not value then
    return false
  end
  local ok, meta = pcall(cjson.decode, value)
  return ok and (meta['status'] == 'SUCCESS' or meta['status'] == 'FAILURE')
end
local function store(key, seconds, value)
  if tonumber(seconds) > 0 then
    redis.call('SETEX', key, seconds, value)
  else
    redis.call('SET', key, value)
  end
end
"""

# Atomically, per request: its job deleted -> "cancelled"; already final -> "final"; else take its lease
# (NX) and store STARTED -> "claimed"; else another batch is scoring it right now -> "busy". KEYS: n result
# keys, n lease keys, then n job-deleted marks. ARGV: batch id, lease seconds, result seconds (0: no
# expiry), then n STARTED metas.
_CLAIM = _LUA_HELPERS + """
local n = #KEYS / 3
local out = {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[2 * n + i]) == 1 then
    out[i] = 'cancelled'
  elseif is_final(KEYS[i]) then
    out[i] = 'final'
  elseif redis.call('SET', KEYS[n + i], ARGV[1], 'NX', 'EX', ARGV[2]) then
    store(KEYS[i], ARGV[3], ARGV[3 + i])
    out[i] = 'claimed'
  else
    out[i] = 'busy'
  end
end
return out
"""

# Drop the leases a batch holds (only its own): KEYS lease keys, ARGV[1] batch id.
_RELEASE = """
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    released = released + redis.call('DEL', KEYS[i])
  end
end
return released
"""


# Extend the leases a batch still holds (only its own): KEYS lease keys, ARGV batch id, lease seconds.
_RENEW = """
local renewed = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    renewed = renewed + redis.call('EXPIRE', KEYS[i], ARGV[2])
  end
end
return renewed
"""

# Store final results, first one wins: a request whose result is already final keeps it and nothing is
# published, so a waiter or observer sees exactly one final result per request. KEYS result keys; ARGV
# result seconds (0: no expiry), then the n metas. Returns how many were written.
_FINAL = _LUA_HELPERS + """
local written = 0
for i = 1, #KEYS do
  if not is_final(KEYS[i]) then
    store(KEYS[i], ARGV[1], ARGV[1 + i])
    redis.call('PUBLISH', KEYS[i], ARGV[1 + i])
    written = written + 1
  end
end
return written
"""


class _LeaseRenewer:
    """One thread per process renewing the leases of every batch it is scoring. A thread per batch
    cost a start and a join per pool call, which small batches feel; batches of a process run one at a
    time, so there is rarely more than one entry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # batch id -> (client, lease keys, lease seconds, when its next renewal is due)
        self._held: dict[str, tuple[Any, list[bytes | str], int, float]] = {}
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
        self._thread.start()

    def add(self, batch_id: str, client: Any, keys: list[bytes | str], lease_seconds: int) -> None:
        with self._lock:
            self._held[batch_id] = (client, keys, lease_seconds, time.monotonic() + _renew_every(lease_seconds))
            self._changed.notify()

    def remove(self, batch_id: str) -> None:
        with self._lock:
            self._held.pop(batch_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [(b, c, k, s) for b, (c, k, s, at) in self._held.items() if at <= now]
                for batch_id, client, keys, seconds in due:
                    self._held[batch_id] = (client, keys, seconds, now + _renew_every(seconds))
                if not due:
                    nxt = min((at for *_, at in self._held.values()), default=None)
                    self._changed.wait(None if nxt is None else nxt - now)
                    continue
            # Outside the lock: a slow Redis must not hold up the batches registering or leaving. A
            # renewal that lands after its batch left is harmless: the script only extends leases
            # that still name this batch, and the batch's result write deleted them.
            for batch_id, client, keys, seconds in due:
                try:
                    client.eval(_RENEW, len(keys), *keys, batch_id, seconds)
                except Exception as exc:  # Redis away: the next renewal tries again; expiry is the fallback
                    logger.warning("batch %s: could not renew its leases (%r)", batch_id, exc)


def _renew_every(lease_seconds: int) -> float:
    return max(lease_seconds / 3, 0.1)


_renewers: dict[int, _LeaseRenewer] = {}


def _renewer() -> _LeaseRenewer:
    """This process's renewer, started on first use (a forked child starts its own: threads do not
    survive a fork)."""
    pid = os.getpid()
    renewer = _renewers.get(pid)
    if renewer is None:
        _renewers.clear()
        renewer = _renewers[pid] = _LeaseRenewer()
    return renewer


@dataclass(frozen=True)
class Outcome:
    """One request's final result: `result` on success, `error` (an exception) on failure, and
    `meta`: extra fields stored with this request's result only (e.g. `cache_hits`)."""

    task_id: str
    result: Any = None
    error: BaseException | None = None
    meta: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        return meta.FAILURE if self.error is not None else meta.SUCCESS


class ResultStore:
    """Batch reads and writes of task result meta, compatible with Celery's RedisBackend."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._expires = int(backend.expires) if backend.expires else None

    def _key(self, task_id: str) -> bytes:
        key: bytes = self._backend.get_key_for_task(task_id)
        return key

    def _write(self, entries: Iterable[tuple[str, dict[str, Any]]], latencies: Sequence[float] = ()) -> None:
        rows = [(task_id, self._backend.encode(stored)) for task_id, stored in entries]
        if not rows:
            return
        ids = [task_id for task_id, _ in rows]
        with self._backend.client.pipeline(transaction=False) as pipe:
            pipe.eval(_FINAL, len(rows), *[self._key(t) for t in ids], self._expires or 0, *[v for _, v in rows])
            # The lease would expire by itself; dropping it with the result just keeps Redis tidy.
            pipe.delete(*[lease_key(t) for t in ids])
            # Final: nothing is left for the sweeper to recover.
            pending.forget(pipe, ids)
            latency.record(pipe, latencies)
            pipe.execute()

    def claim(self, task_ids: Sequence[str], batch_id: str, lease_seconds: int,
              extra: dict[str, Any]) -> list[str]:
        """Take the requests this batch will score, in one atomic round trip: per task id "claimed"
        (leased to this batch and stored as STARTED, which the API reports as running), "cancelled"
        (its job was deleted, `DELETE /v1/jobs/{id}`: nothing is stored), "final" (a result is
        already stored: a redelivery) or "busy" (another batch holds its lease: a redelivery while that
        batch runs or before its lease expired after its worker died; the caller must leave this
        message unacked, for Redis to redeliver)."""
        if not task_ids:
            return []
        metas = [self._backend.encode(meta.build(meta.STARTED, None, task_id=t, date_done=None, extra=extra))
                 for t in task_ids]
        # The deletion mark is read in the same script: one round trip per batch, not two.
        keys = [self._key(t) for t in task_ids] + [lease_key(t) for t in task_ids] \
            + [cancelled_key(job_of(t)) for t in task_ids]
        answer = self._backend.client.eval(_CLAIM, len(keys), *keys, batch_id, lease_seconds, self._expires or 0,
                                           *metas)
        return [a.decode() if isinstance(a, bytes) else str(a) for a in answer]

    @contextlib.contextmanager
    def holding(self, task_ids: Sequence[str], batch_id: str, lease_seconds: int) -> Iterator[None]:
        """Keep this batch's leases alive while it scores. A lease lasts half a visibility timeout
        (`WorkerSettings.lease_seconds`): a batch slower than that (a loaded host) would otherwise lose
        its leases, and a copy of its requests delivered meanwhile (the worker's main process keeps
        their messages from being redelivered, but a stalled one may fail to) would be claimed by a
        second batch and scored twice. Renewed every third of a lease, so two missed renewals still
        leave it held."""
        if not task_ids:
            yield
            return
        renewer = _renewer()
        renewer.add(batch_id, self._backend.client, [lease_key(t) for t in task_ids], lease_seconds)
        try:
            yield
        finally:
            renewer.remove(batch_id)

    def release(self, task_ids: Sequence[str], batch_id: str) -> None:
        """Give up this batch's leases (its pool process died), so a retry can claim the requests."""
        if task_ids:
            self._backend.client.eval(_RELEASE, len(task_ids), *[lease_key(t) for t in task_ids], batch_id)

    def store(self, outcomes: Sequence[Outcome], extra: dict[str, Any],
              sent_at: Mapping[str, Any] | None = None) -> None:
        """Record final results and failures, and wake anyone waiting on them. `sent_at`: task id -> the
        API's publish time of its message, recorded with them as a job latency sample (`fleet.latency`)."""
        stamp = time.time()
        now = datetime.fromtimestamp(stamp, UTC).isoformat()
        sent = sent_at or {}
        latencies = [max(0.0, stamp - s) for o in outcomes if isinstance(s := sent.get(o.task_id), int | float)]

        def final(o: Outcome) -> dict[str, Any]:
            result = self._backend.prepare_exception(o.error) if o.error is not None else o.result
            return meta.build(o.state, result, task_id=o.task_id, date_done=now, extra={**extra, **(o.meta or {})})

        self._write(((o.task_id, final(o)) for o in outcomes), latencies)
