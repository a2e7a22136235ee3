"""The `toxfleet.score` task: validate each request, score the whole batch at once, store per request."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from toxfleet import contract
from worker import lifecycle, metrics
from worker.batching import BatchTask
from worker.celery_app import app
from worker.results import Outcome, ResultStore
from worker.settings import get_settings

logger = logging.getLogger(__name__)


def validate(args: Any, kwargs: Any, max_texts: int, max_chars: int) -> list[str]:
    """The texts of a request, or ValueError saying what is wrong with it."""
    if kwargs:
        raise ValueError(f"unexpected keyword arguments: {sorted(kwargs)}")
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
    return texts


class ScoreTask(BatchTask):
    """Score texts with Detoxify. Called directly, `score.delay(texts)` returns one dict per text."""

    name = contract.SCORE_TASK
    acks_late = True

    def run(self, texts: list[str]) -> list[dict[str, float]]:
        # Only reached when the task is applied eagerly in-process; workers call run_batch.
        settings = get_settings()
        results, _ = lifecycle.scorer().score(validate([texts], {}, settings.max_texts, settings.max_text_chars))
        return results

    def cost(self, args: Any, kwargs: Any) -> int:
        return sum(contract.estimate_tokens(t) for t in args[0])

    def on_batch_lost(self, batch_id: str, task_ids: list[str]) -> None:
        ResultStore(self.backend).release(task_ids, batch_id)

    def on_worker_lost(self, request: Any, reason: str) -> None:
        ResultStore(self.backend).store([Outcome(request.id, error=RuntimeError(reason))], {})
        metrics.count_failures("worker_lost")

    def run_batch(self, batch_id: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        metrics.observe_queue_waits(r.get("sent_at") for r in requests)
        settings = get_settings()
        scorer = lifecycle.scorer()
        store = ResultStore(self.backend)
        extra: dict[str, Any] = {"model": scorer.backend.identity,
                                 "batch": {"id": batch_id, "requests": len(requests), "pid": os.getpid()}}

        outcomes: dict[str, dict[str, Any]] = {}
        texts: dict[str, list[str]] = {}
        failed: list[Outcome] = []
        # A redelivered request is never scored twice: not after its result is stored ("final"),
        # nor while another batch scores it ("busy"; the lease lasts as long as a delivery may).
        claims = store.claim([r["id"] for r in requests], batch_id, settings.visibility_timeout, extra)
        for req, claim in zip(requests, claims, strict=True):
            if claim != "claimed":
                outcomes[req["id"]] = {"state": "SKIPPED", "summary": f"duplicate delivery ({claim})"}
                continue
            try:
                texts[req["id"]] = validate(req["args"], req["kwargs"], settings.max_texts, settings.max_text_chars)
            except ValueError as exc:
                logger.warning("request %s rejected: %s", req["id"], exc, extra={"task_id": req["id"]})
                failed.append(Outcome(req["id"], error=exc))

        done = self._score(scorer, texts, batch_id)
        store.store(done + failed, extra)
        metrics.count_tasks("skipped", len(requests) - len(texts) - len(failed))
        metrics.count_tasks("succeeded", sum(1 for o in done if o.error is None))
        metrics.count_failures("invalid", len(failed))
        for o in done + failed:
            outcomes[o.task_id] = {"state": o.state, "error": repr(o.error) if o.error else None,
                                   "summary": f"{len(texts.get(o.task_id, []))} texts"}
        runtime = time.perf_counter() - started
        for summary in outcomes.values():
            summary["runtime"] = runtime
        return [outcomes[r["id"]] for r in requests]

    def _score(self, scorer: Any, texts: dict[str, list[str]], batch_id: str) -> list[Outcome]:
        """Score every request's texts in one call; if that fails, find the request that fails."""
        if not texts:
            return []
        flat = [t for ts in texts.values() for t in ts]
        fields = {"batch_id": batch_id, "job_ids": sorted({contract.job_of(t) for t in texts})}
        t0 = time.perf_counter()
        try:
            scores, stats = scorer.score(flat)
        except Exception as exc:
            if len(texts) == 1:
                logger.exception("batch %s: scoring failed", batch_id, extra=fields)
                metrics.count_failures("scoring")
                return [Outcome(next(iter(texts)), error=RuntimeError(f"scoring failed: {exc!r}"))]
            logger.warning("batch %s: scoring %d requests together failed (%r); retrying one by one",
                           batch_id, len(texts), exc, extra=fields)
            return [o for task_id, ts in texts.items() for o in self._score(scorer, {task_id: ts}, batch_id)]
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


score = app.register_task(ScoreTask())
