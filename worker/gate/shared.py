"""The runtime gate's records in Redis: one decision per decision key, shared by the fleet, and the
lock, progress, failure and history records around it (key names: `fleet.keys.gate_key`).

A decision key is a digest of what a decision depends on: the checkpoint's sha256, the int8 recipe, the
CPU's kernel signature and the deciding library versions. Workers on the same kind of CPU, running the
same checkpoint and image, compute the same key, so one gate serves them all. A record read back is
trusted only if it parses as a `Decision` of this format that holds here (`Decision.invalid_because`);
anything else is ignored with a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from typing import Any

from fleet.keys import GATE_RECORD_SECONDS, gate_key
from worker.cpus import kernel_signature
from worker.gate.decision import DECIDING_VERSIONS, Decision
from worker.onnx_export.artifacts import DEFAULT_INT8, EXPORT_FORMAT, installed_version

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20
"""A decision record larger than this is not parsed (a gate table is a few kilobytes)."""

RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0"""
"""Extend the lock only while this holder still has it."""

RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0"""
"""Delete the lock only while this holder still has it."""


def decision_key(checkpoint_sha: str) -> str:
    """The digest a decision for this checkpoint, on this CPU and with these libraries, is stored under."""
    what = {"checkpoint_sha256": checkpoint_sha, "int8_recipe": DEFAULT_INT8.record(), "export_format": EXPORT_FORMAT,
            "kernel_signature": kernel_signature(),
            "versions": {dist: installed_version(dist) for dist in DECIDING_VERSIONS}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def parse_decision(raw: bytes | str | None, checkpoint_sha: str) -> Decision | str:
    """The decision in a Redis record if it holds here, else why not (None: no record)."""
    if raw is None:
        return "no decision published"
    if len(raw) > MAX_RECORD_BYTES:
        return f"decision record of {len(raw)} bytes (more than {MAX_RECORD_BYTES})"
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        decision = Decision(**data)
        if not isinstance(decision.chosen, str) or not isinstance(decision.rows, list):
            raise TypeError("chosen or rows of the wrong type")
    except (ValueError, TypeError) as exc:
        return f"unreadable decision record ({exc})"
    reason = decision.invalid_because(checkpoint_sha)
    return decision if reason is None else reason


def read_decision(client: Any, digest: str, checkpoint_sha: str) -> Decision | None:
    """The published decision for `digest` if there is one that holds here; a record that does not
    hold is logged and ignored (never trusted). RedisError propagates."""
    raw = client.get(gate_key("decision", digest))
    found = parse_decision(raw, checkpoint_sha)
    if isinstance(found, str):
        if raw is not None:
            logger.warning("runtime gate: ignoring the decision record %s: %s", gate_key("decision", digest), found)
        return None
    return found


REPLACE = """if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) return 1 end
return 0"""
"""Replace a record only if it is still the one read."""


def publish_decision(client: Any, digest: str, decision: Decision) -> bool:
    """Store `decision` unless a decision that holds here is already published (the first one stands:
    racing gates make one decision); a record that does not hold (unreadable, another checkpoint) is
    replaced. True if this one was stored."""
    key, record = gate_key("decision", digest), json.dumps(asdict(decision), sort_keys=True)
    for _ in range(3):
        if client.set(key, record, nx=True, ex=GATE_RECORD_SECONDS):
            return True
        raw = client.get(key)
        if raw is None:
            continue  # expired or deleted since: try to be the first again
        if not isinstance(parse_decision(raw, decision.checkpoint_sha256), str):
            return False
        if client.eval(REPLACE, 1, key, raw, record, GATE_RECORD_SECONDS):
            logger.info("runtime gate: replaced the decision record %s, which did not hold here", key)
            return True
    return False


def take_lock(client: Any, digest: str, token: str, ttl_ms: int) -> bool:
    """Take the gate lock for `digest` if nobody holds it."""
    return bool(client.set(gate_key("lock", digest), token, nx=True, px=ttl_ms))


def renew_lock(client: Any, digest: str, token: str, ttl_ms: int) -> bool:
    """Extend the lock; False when this holder lost it (expired, or taken by another)."""
    return bool(client.eval(RENEW, 1, gate_key("lock", digest), token, ttl_ms))


def release_lock(client: Any, digest: str, token: str) -> None:
    client.eval(RELEASE, 1, gate_key("lock", digest), token)


def lock_holder(client: Any, digest: str) -> str | None:
    raw = client.get(gate_key("lock", digest))
    return raw.decode() if isinstance(raw, bytes) else raw


def set_progress(client: Any, digest: str, line: str, ttl_ms: int) -> None:
    client.set(gate_key("progress", digest), line[:500], px=ttl_ms)


def progress(client: Any, digest: str) -> str | None:
    raw = client.get(gate_key("progress", digest))
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def record_run(client: Any, digest: str, worker: str, pid: int) -> None:
    """Append a started gate to the history (kept to the last 100)."""
    key = gate_key("runs", digest)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps({"worker": worker, "pid": pid, "started": time.time()}))
        pipe.ltrim(key, -100, -1)
        pipe.expire(key, GATE_RECORD_SECONDS)
        pipe.execute()


def runs(client: Any, digest: str) -> list[dict[str, Any]]:
    """The gates started for `digest`, oldest first."""
    return [json.loads(r) for r in client.lrange(gate_key("runs", digest), 0, -1)]


def failure(client: Any, digest: str) -> dict[str, Any] | None:
    """The last failed gate for `digest` (`attempts`, `retry_at`, `reason`), if one is remembered."""
    raw = client.get(gate_key("failed", digest))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return {"attempts": int(data["attempts"]), "retry_at": float(data["retry_at"]),
                "reason": str(data.get("reason", ""))}
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("runtime gate: ignoring the failure record %s (%r)", gate_key("failed", digest), exc)
        return None


def record_failure(client: Any, digest: str, attempts: int, retry_at: float, reason: str, keep_s: float) -> None:
    """Remember a failed gate, so that the whole fleet waits until `retry_at` (kept `keep_s` to count attempts)."""
    client.set(gate_key("failed", digest),
               json.dumps({"attempts": attempts, "retry_at": retry_at, "reason": reason[:1000]}),
               ex=max(1, int(keep_s)))


def clear_failure(client: Any, digest: str) -> None:
    client.delete(gate_key("failed", digest))
