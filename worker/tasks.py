"""The `toxfleet.score` task: validate each request, answer cached texts from the score cache, score
the rest of the whole batch at once, store per request."""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import RedisError

from fleet import pending
from fleet import redis_url as urls
from fleet.cache import ScoreCache, Scores, namespace
from toxfleet import contract
from worker import executions, metrics, state
from worker.batching import BatchTask
from worker.celery_app import app
from worker.results import Outcome, ResultStore
from worker.settings import get_settings

logger = logging.getLogger(__name__)


def long_text_of(kwargs: Any) -> str:
    """The request's `long_text` mode (default "truncate"), or ValueError for any other keyword."""
    if not isinstance(kwargs, dict):
        raise ValueError("keyword arguments must be a mapping")
    unexpected = sorted(set(kwargs) - {"long_text"})
    if unexpected:
        raise ValueError(f"unexpected keyword arguments: {unexpected}")
    mode = kwargs.get("long_text", contract.TRUNCATE)
    if mode not in contract.LONG_TEXT_MODES:
        raise ValueError(f"long_text must be one of {list(contract.LONG_TEXT_MODES)}, got {mode!r}")
    return str(mode)


def validate(args: Any, kwargs: Any, max_texts: int, max_chars: int) -> list[str]:
    """The texts of a request, or ValueError saying what is wrong with it (texts or keywords)."""
    long_text_of(kwargs or {})
    if not isinstance(args, list | tuple) or len(args) != 1:
        raise ValueError("expected exactly one argument: a list of texts")
    texts = args[0]
    if not isinstance(texts, list) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    if len(texts) > max_texts:
        raise ValueError(f"too many texts: {len(texts)} > {max_texts}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] is not a string")
        if len(text) > max_chars:
            raise ValueError(f"texts[{i}] has {len(text)} characters > {max_chars}")
        if not contract.is_unicode(text):
            raise ValueError(f"texts[{i}] is not valid Unicode: a lone surrogate (U+D800-U+DFFF not in a pair)")
    return texts


class ScoreTask(BatchTask):
    """Score texts with Detoxify. Called directly, `score.delay(texts)` returns one dict per text."""

    name = contract.SCORE_TASK
    acks_late = True

    def __init__(self) -> None:
        super().__init__()
        # The consumer's flush budget and the retry limit after a lost pool process come from the
        # worker's settings, read once like every other (the task object is built at import).
        settings = get_settings()
        self.batch_tokens = settings.batch_tokens
        self.bulk_batch_tokens = settings.bulk_batch_tokens
        self.max_retries = settings.max_retries
        self.renew_every = settings.renew_seconds

    def run(self, texts: list[str], long_text: str = contract.TRUNCATE) -> list[dict[str, float]]:
        # Only reached when the task is applied eagerly in-process; workers call run_batch.
        settings = get_settings()
        kwargs = {"long_text": long_text}
        results, _ = state.scorer().score(validate([texts], kwargs, settings.max_texts, settings.max_text_chars),
                                              long_text_of(kwargs))
        return results

    def cost(self, args: Any, kwargs: Any) -> int:
        mode = (kwargs or {}).get("long_text", contract.TRUNCATE)
        return sum(contract.estimate_tokens(t, mode) for t in args[0])

    bulk_queues = frozenset({contract.BULK_QUEUE})

    def describe(self, args: Any) -> str:
        return contract.args_summary(args)

    def on_batch_lost(self, batch_id: str, task_ids: list[str]) -> None:
        ResultStore(self.backend).release(task_ids, batch_id)

    def on_worker_lost(self, request: Any, reason: str) -> None:
        ResultStore(self.backend).store([Outcome(request.id, error=RuntimeError(reason))], {})
        metrics.count_failures("worker_lost")

    def on_publish_again(self, task_id: str, stamp: float) -> None:
        # The pending time must equal the new message's stamp (worker.sweeper compares the two).
        pending.restamp(self.backend.client, task_id, stamp)

    def run_batch(self, batch_id: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        metrics.observe_queue_waits(r.get("sent_at") for r in requests)
        settings = get_settings()
        scorer = state.scorer()
        store = ResultStore(self.backend)
        extra: dict[str, Any] = {"model": scorer.backend.identity, "backend": scorer.backend.name,
                                 "batch": {"id": batch_id, "requests": len(requests), "pid": os.getpid()},
                                 "started_at": datetime.now(UTC).isoformat()}
        outcomes: dict[str, dict[str, Any]] = {}
        texts: dict[str, list[str]] = {}
        modes: dict[str, str] = {}
        failed: list[Outcome] = []
        # A deleted job's requests are acked unscored. A redelivered request is never scored twice:
        # not after its result is stored ("final"), nor while another batch scores it ("busy"; the
        # lease is renewed while this batch runs).
        claims = store.claim([r["id"] for r in requests], batch_id, settings.lease_seconds, extra)
        for req, claim in zip(requests, claims, strict=True):
            if claim == "cancelled":
                outcomes[req["id"]] = {"state": "SKIPPED", "summary": "job deleted"}
                continue
            if claim == "final":
                outcomes[req["id"]] = {"state": "SKIPPED", "summary": "duplicate delivery (result already stored)"}
                continue
            if claim == "busy":
                # The lease holder may be dead (its whole worker killed), making this the only copy
                # left: acking it would lose the request. Unacked and no longer renewed (the main
                # process renews only what it still holds), Redis redelivers it one visibility timeout
                # later, when the lease (half of one, from its last renewal, which came first) has
                # expired or the holder has stored the result.
                outcomes[req["id"]] = {"state": "DEFERRED", "summary": "leased to another batch"}
                continue
            try:
                texts[req["id"]] = validate(req["args"], req["kwargs"], settings.max_texts, settings.max_text_chars)
                modes[req["id"]] = long_text_of(req["kwargs"] or {})
            except ValueError as exc:
                logger.warning("request %s rejected: %s", req["id"], exc, extra={"task_id": req["id"]})
                failed.append(Outcome(req["id"], error=exc))

        # Held (renewed) until the results are stored: a slow batch must not lose its requests to a
        # redelivery that finds their leases expired and scores them a second time.
        claimed = [r["id"] for r, c in zip(requests, claims, strict=True) if c == "claimed"]
        executions.record(settings.execution_log, batch_id, claimed)
        with store.holding(claimed, batch_id, settings.lease_seconds):
            # Cached texts skip the model; only the rest are scored, then cached in turn.
            cached = self._cached(scorer.backend, texts, modes, batch_id)
            todo = {rid: [t for t, c in zip(ts, cached[rid], strict=True) if c is None] for rid, ts in texts.items()}
            todo = {rid: ts for rid, ts in todo.items() if ts}
            scored = {o.task_id: o for o in self._score(scorer, todo, modes, batch_id)}
            self._remember(scorer.backend, todo, modes, scored, batch_id)
            done = [_merge(rid, cached[rid], scored.get(rid)) for rid in texts]

            store.store(done + failed, extra, {r["id"]: r.get("sent_at") for r in requests})
        deferred = sum(1 for o in outcomes.values() if o["state"] == "DEFERRED")
        cancelled = claims.count("cancelled")
        metrics.count_tasks("cancelled", cancelled)
        metrics.count_tasks("skipped", len(requests) - cancelled - len(texts) - len(failed) - deferred)
        metrics.count_tasks("deferred", deferred)
        metrics.count_tasks("succeeded", sum(1 for o in done if o.error is None))
        metrics.count_failures("invalid", len(failed))
        for o in done + failed:
            outcomes[o.task_id] = {"state": o.state, "error": repr(o.error) if o.error else None,
                                   "summary": f"{len(texts.get(o.task_id, []))} texts"}
        runtime = time.perf_counter() - started
        for summary in outcomes.values():
            summary["runtime"] = runtime
        return [outcomes[r["id"]] for r in requests]

    def _cached(self, backend: Any, texts: dict[str, list[str]], modes: dict[str, str],
                batch_id: str) -> dict[str, list[Scores | None]]:
        """Cached scores per request and text (None: not cached), one MGET per long-text mode. Keyed
        by the model identity and the backend this process really runs (`auto` resolved)."""
        found: dict[str, list[Scores | None]] = {rid: [None] * len(ts) for rid, ts in texts.items()}
        cache = score_cache()
        if cache is None or not texts:
            return found
        try:
            for mode in set(modes.values()):
                rids = [rid for rid in texts if modes[rid] == mode]
                flat = cache.get(namespace(backend.identity, backend.name, mode),
                                 [t for rid in rids for t in texts[rid]])
                metrics.count_cache(len(flat), sum(f is not None for f in flat))
                offset = 0
                for rid in rids:
                    found[rid] = flat[offset: offset + len(texts[rid])]
                    offset += len(texts[rid])
        except RedisError as exc:  # the cache is an optimisation: never fail a batch over it
            logger.warning("batch %s: score cache unavailable (%r); scoring everything", batch_id, exc)
            return {rid: [None] * len(ts) for rid, ts in texts.items()}
        return found

    def _remember(self, backend: Any, todo: dict[str, list[str]], modes: dict[str, str],
                  scored: dict[str, Outcome], batch_id: str) -> None:
        cache = score_cache()
        if cache is None:
            return
        try:
            for mode in set(modes.values()):
                ok = [rid for rid in todo if modes[rid] == mode and scored[rid].error is None]
                cache.put(namespace(backend.identity, backend.name, mode), [t for rid in ok for t in todo[rid]],
                          [s for rid in ok for s in scored[rid].result])
        except RedisError as exc:
            logger.warning("batch %s: could not write the score cache (%r)", batch_id, exc)

    def _score(self, scorer: Any, texts: dict[str, list[str]], modes: dict[str, str], batch_id: str) -> list[Outcome]:
        """Score every request's texts in one call; if that fails, find the request that fails."""
        if not texts:
            return []
        flat = [t for ts in texts.values() for t in ts]
        fields = {"batch_id": batch_id, "job_ids": sorted({contract.job_of(t) for t in texts})}
        flat_modes = [modes[rid] for rid, ts in texts.items() for _ in ts]
        t0 = time.perf_counter()
        try:
            scores, stats = scorer.score(flat, flat_modes)
        except Exception as exc:
            if len(texts) == 1:
                logger.exception("batch %s: scoring failed", batch_id, extra=fields)
                metrics.count_failures("scoring")
                return [Outcome(next(iter(texts)), error=RuntimeError(f"scoring failed: {exc!r}"))]
            logger.warning("batch %s: scoring %d requests together failed (%r); retrying one by one",
                           batch_id, len(texts), exc, extra=fields)
            return [o for task_id, ts in texts.items() for o in self._score(scorer, {task_id: ts}, modes, batch_id)]
        seconds = time.perf_counter() - t0
        metrics.observe_batch(len(texts), stats, seconds)
        logger.info("batch %s: requests=%d texts=%d passes=%d tokens=%d padded=%d seconds=%.3f",
                    batch_id, len(texts), stats.texts, stats.passes, stats.tokens, stats.padded_tokens, seconds,
                    extra={**fields, "requests": len(texts), "texts": stats.texts, "passes": stats.passes,
                           "tokens": stats.tokens, "padded_tokens": stats.padded_tokens, "seconds": seconds})
        out: list[Outcome] = []
        offset = 0
        for task_id, ts in texts.items():
            out.append(Outcome(task_id, result=scores[offset: offset + len(ts)]))
            offset += len(ts)
        return out


def _merge(task_id: str, cached: list[Scores | None], scored: Outcome | None) -> Outcome:
    """A request's outcome from its cached scores and the scores of the rest (in text order)."""
    if scored is not None and scored.error is not None:
        return scored
    fresh = iter(scored.result if scored is not None else [])
    results = [c if c is not None else next(fresh) for c in cached]
    return Outcome(task_id, result=results, meta={"cache_hits": sum(c is not None for c in cached)})


_cache: ScoreCache | None = None


def score_cache() -> ScoreCache | None:
    """This process's score cache client (None when `TOXFLEET_CACHE` is off); made on first use,
    in the pool process, never before the fork."""
    global _cache
    settings = get_settings()
    if not settings.cache:
        return None
    if _cache is None:
        client = urls.sync_client(settings.cache_url or settings.redis_url, socket_timeout=2,
                                  socket_connect_timeout=2)
        _cache = ScoreCache(client, settings.cache_ttl, settings.cache_max_entries)
    return _cache


score = app.register_task(ScoreTask())
