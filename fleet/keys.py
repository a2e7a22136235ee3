"""Every Redis key and channel toxfleet uses, and the worker heartbeat stored under two of them.

Names and value formats are part of a deployed fleet (API and workers of different versions share
one Redis during a rollout), so they are spelt once, here. Celery's own keys (result metas, named
by `backend.get_key_for_task`) and the queue list (`contract.QUEUE`) are not repeated here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""Broker, result backend and cache when `REDIS_URL` is not set (every process reads the same one)."""

UNACKED_KEY = "unacked"
"""Redis hash in which kombu keeps messages delivered to a worker and not yet acknowledged (kombu's
default `unacked_key`): with late acks, every message a worker has buffered or is scoring."""

PENDING_KEY = "toxfleet:pending"
"""Redis sorted set: task id -> unix time its current message was published, for every task the API
sent that has no final result yet (see `fleet.pending`)."""

PENDING_ARGS_KEY = "toxfleet:pending:args"
"""Redis hash: task id -> JSON `{"args": ..., "kwargs": ...}` of a pending task (see `PENDING_KEY`)."""

JOB_LATENCY_KEY = "toxfleet:latency"
"""Redis list: seconds from a task message's publish to its final result, pushed by the workers and
drained by the backlog publisher (see `fleet.latency`)."""

LEASE_PREFIX = "toxfleet:lease:"
"""Redis key prefix of the lease a batch takes on each request it scores (value: the batch id)."""

SWEEP_LOCK_KEY = "toxfleet:sweep:lock"
"""Held by the worker sweeping for lost messages this round (one sweeper per round)."""

SWEEP_SUSPECTS_KEY = "toxfleet:sweep:suspects"
"""Redis hash: task id -> unix time a sweep first found its message nowhere."""

JOB_KEY_PREFIX = "toxfleet:job:"
"""Redis key prefix of job manifests."""

SUBMIT_ACK_KEY = "toxfleet:submit:acks"
"""Redis counter the API increments after a job's writes when `TOXFLEET_SUBMIT_MIN_REPLICAS` is set: the
write that `WAIT` then waits on (one key, no expiry: bounded)."""

CANCELLED_KEY_PREFIX = "toxfleet:cancelled:"
"""Redis key prefix marking a deleted job (value "1"): workers skip its requests not yet scored."""


def cancelled_key(job_id: str) -> str:
    return CANCELLED_KEY_PREFIX + job_id


IDEMPOTENCY_KEY_PREFIX = "toxfleet:idem:"
"""Redis key prefix of Idempotency-Key records (the client's key is stored hashed)."""

RATE_KEY_PREFIX = "toxfleet:rate:"
"""Redis key prefix of the per-key, per-second request counters."""

CACHE_PREFIX = "toxfleet:cache:"
"""Redis key prefix of the score cache (`fleet.cache`: entries, index and stats)."""

WORKERS_KEY = "toxfleet:workers"
"""Redis sorted set: worker hostname -> unix time of its last heartbeat."""

WORKER_INFO_PREFIX = "toxfleet:worker:"
"""Redis key prefix of a worker's `Heartbeat` (JSON), expiring."""

GATE_PREFIX = "toxfleet:gate:"
"""Redis key prefix of the runtime fidelity gate's records, one set per decision key (a digest of the
checkpoint, the int8 recipe, the CPU's kernel signature and the deciding library versions):
`decision:<digest>` (JSON of a worker's `Decision`), `lock:<digest>` (held by the one worker gating),
`progress:<digest>` (its last progress line), `failed:<digest>` (the last failure and when to retry:
the fleet's shared backoff) and `runs:<digest>` (a list, one entry per gate started)."""

GATE_RECORD_SECONDS = 90 * 86_400
"""How long a published decision and its history are kept (a new library version or image asks anew)."""


def gate_key(kind: str, digest: str) -> str:
    """The runtime gate's `kind` record ("decision", "lock", "progress", "failed", "runs") for a decision key."""
    if kind not in ("decision", "lock", "progress", "failed", "runs"):
        raise ValueError(f"unknown gate record {kind!r}")
    return f"{GATE_PREFIX}{kind}:{digest}"


HEARTBEAT_SECONDS = 5.0
"""Seconds between two heartbeats of a worker."""

HEARTBEAT_STALE_SECONDS = 15
"""A worker whose last heartbeat is older than this is not counted as answering."""


def job_key(job_id: str) -> str:
    return JOB_KEY_PREFIX + job_id


def lease_key(task_id: str) -> str:
    return LEASE_PREFIX + task_id


def rate_key(ident: str, second: int) -> str:
    """The counter of key `ident`'s requests in the one-second window `second` (unix time)."""
    return f"{RATE_KEY_PREFIX}{ident}:{second}"


def worker_info_key(hostname: str) -> str:
    return WORKER_INFO_PREFIX + hostname


@dataclass(frozen=True)
class Heartbeat:
    """What a worker says about itself under `worker_info_key(hostname)`, while its hostname is beating
    in `WORKERS_KEY`. The API reads `model`, `backend` and `cache` (may the score cache answer?),
    `concurrency` (the backpressure limit) and `configured` (its metrics); the rest is for people.
    Field order is the JSON's."""

    hostname: str
    model: str | None = None
    backend: str | None = None
    configured: str | None = None
    """The `TOXFLEET_BACKEND` the worker was started with (`auto` or a name), beside the `backend` it
    runs: `auto` running the reference means the fast path was lost (an alert watches for it)."""
    cache: bool = False
    concurrency: int = 1
    pid: int | None = None
    host: str | None = None
    model_loads: int | None = None
    gate: dict[str, Any] | None = None
    """When `auto` chose the backend: the fidelity gate's figures for it (`worker.gate.selection.gate_figures`:
    max_abs, p99_abs, flips_pct, min_spearman, texts_per_s, decided_at); None for a backend set by name."""
    why: str | None = None
    """Why this backend: set by name, the decision behind it, or why `auto` runs the reference."""
    gating: dict[str, Any] | None = None
    """With `auto`: the runtime gate for this worker's kind of CPU (`worker.gate.background`): `state`
    (gating, waiting, backoff, decided, off, unavailable), and as known `holder`, `progress`, `attempts`,
    `retry_at`, `last_error`; None from a worker that does not gate at run time."""

    @property
    def chosen_by(self) -> str:
        """How the worker came to run `backend` (a metrics label): `name` (set by name), `gate` (`auto`,
        from a fidelity decision, whichever backend it chose), `fallback` (`auto` with no decision behind
        it: the reference, the fast path lost, as while a runtime gate runs), `unknown` (not said)."""
        if self.configured is None:
            return "unknown"
        if self.configured != "auto":
            return "name"
        return "gate" if self.gate is not None else "fallback"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> Heartbeat:
        """Tolerant of fields an older or newer worker does (not) write."""
        data: dict[str, Any] = json.loads(raw)
        return cls(hostname=str(data.get("hostname", "")), model=data.get("model"), backend=data.get("backend"),
                   configured=data.get("configured"), cache=bool(data.get("cache")),
                   concurrency=int(data.get("concurrency", 1)),
                   pid=data.get("pid"), host=data.get("host"), model_loads=data.get("model_loads"),
                   gate=gate if isinstance(gate := data.get("gate"), dict) else None,
                   why=why if isinstance(why := data.get("why"), str) else None,
                   gating=gating if isinstance(gating := data.get("gating"), dict) else None)

    def write(self, pipe: Any, now: float) -> None:
        """Queue one beat on a (sync) pipeline: the hostname's time, and this description, which
        expires after three missed beats."""
        pipe.zadd(WORKERS_KEY, {self.hostname: now})
        pipe.set(worker_info_key(self.hostname), self.encode(), ex=int(HEARTBEAT_SECONDS * 3))

    @staticmethod
    def clear(client: Any, hostname: str) -> None:
        """A worker leaving says so at once (else it counts until its beat goes stale)."""
        client.zrem(WORKERS_KEY, hostname)
        client.delete(worker_info_key(hostname))
