"""A Celery task base that scores many queued requests in one pool call.

Modelled on clokep/celery-batches (its message handling is adapted from there) but changed where
that library was measured to hurt a latency-sensitive model server:

- **No flush timer.** A batch is handed to a pool process as soon as one is free, holding whatever is
  buffered then (continuous batching, as TEI and Triton do): an idle fleet adds no wait, a busy one
  batches by itself. There is no timer to die on a broker reconnect (celery-batches #107).
- **Token budget.** A flush takes buffered requests up to an estimated token budget, not a count,
  and when several pool processes are idle at once the buffer is shared out between them rather
  than handed whole to the first.
- **Failures stay per request.** The pool side writes every request's own outcome; the main process
  acks each request only after its outcome is stored.
- **Worker loss is handled.** If the pool process dies mid-batch, each request is re-published with
  `retries + 1` and then acked (a re-published request runs alone, so an innocent neighbour is not
  failed with it); past `max_retries` it is stored as failed with the reason.
- **Flower sees every request**, from one event each: its succeeded/failed (or retried) event
  carries what task-received would (name, args, kwargs, retries, received time), and Flower's event
  state merges the fields of any task event, so it lists the task by name. A task-received event per
  request was one more publish on the consumer's hot path (and one more event for Flower to consume);
  a request appears in Flower when it finishes, not while it waits. Worker state
  (`inspect active/reserved`) stays accurate.
- **Held messages stay held.** Every `renew_every` seconds the main process renews, in the broker's
  unacked index, the delivery time of every message it holds (buffered or in a batch not yet
  returned), so Redis redelivers a message only when the worker holding it has died, however long
  it waited or ran here; a dead worker's messages come back one visibility timeout after its last
  renewal.

ETA/countdown are not supported: a scoring request is wanted now.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from time import monotonic, time
from typing import Any

from billiard.einfo import ExceptionInfo
from celery import current_app, signals
from celery.app.task import Task
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request, create_request_cls
from celery.worker.state import task_accepted, task_ready, task_reserved
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2
from kombu.utils.uuid import uuid

from fleet.transport import renew_deliveries
from toxfleet.contract import SENT_AT_HEADER

logger = logging.getLogger(__name__)

_pool_tasks: dict[str, BatchTask] = {}


def _run_in_pool(task_name: str, batch_id: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Runs in the pool process, where the model was loaded at process init. The task comes by name and
    # is looked up once per process: a pickled task object is unpickled by re-importing its module and
    # looking it up in the app on every call, a cost a small batch feels.
    task = _pool_tasks.get(task_name)
    if task is None:
        task = _pool_tasks[task_name] = current_app.tasks[task_name]
    outcomes = task.run_batch(batch_id, requests)
    if len(outcomes) != len(requests):
        raise RuntimeError(f"run_batch returned {len(outcomes)} outcomes for {len(requests)} requests")
    return outcomes


class BatchTask(Task):  # type: ignore[misc]
    """Subclass and implement `run_batch(batch_id, requests) -> outcomes` (list in, list out).

    Each request is `{"id", "args", "kwargs", "retries", "sent_at"}` (`sent_at`: the publisher's
    `SENT_AT_HEADER`, or None); each outcome is
    `{"state": "SUCCESS" | "FAILURE" | "SKIPPED" | "DEFERRED", "error": str | None}` after the subclass
    has stored the request's result itself (SKIPPED: already stored, the message is acked; DEFERRED:
    not this batch's to score now, the message is left unacked for Redis to redeliver).
    `cost(args, kwargs)` estimates a request's tokens.
    """

    abstract = True
    typing = True
    batch_tokens: int
    """Estimated tokens one pool call takes from the buffer (at least one request); the subclass sets it
    from its settings (`TOXFLEET_BATCH_TOKENS`), which own the default."""
    bulk_batch_tokens: int
    """Estimated tokens one pool call takes when only bulk work waits (`TOXFLEET_BULK_BATCH_TOKENS`). A
    batch is never interrupted, so this bounds how long an interactive request that arrives next waits."""
    max_retries: int = 2
    bulk_queues: frozenset[str] = frozenset()
    """Queues of low-priority work: buffered behind every request from another queue."""
    renew_every: float = 0.0
    """Seconds between two renewals of the held messages' delivery times (`_renew_held`); 0: none.
    Must be well under the broker's visibility timeout."""

    def __init__(self) -> None:
        # Created once per task object, not per Strategy call: Celery rebuilds strategies when the
        # consumer reconnects to the broker, while batches dispatched before that are still running.
        self._buffer: deque[tuple[Request, int]] = deque()
        # batch id -> its requests and their estimated tokens, from dispatch until it returns
        self._in_flight: dict[str, tuple[list[Request], int]] = {}
        self._unaccepted: set[str] = set()  # batches handed to the pool that no process has started
        self._pool: Any = None
        self._renewal: Any = None  # the consumer timer's entry that calls _renew_held

    def run_batch(self, batch_id: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def cost(self, args: Any, kwargs: Any) -> int:
        return 1

    def on_batch_lost(self, batch_id: str, task_ids: list[str]) -> None:
        """Undo what a batch whose pool process died still holds, before its requests are retried
        (main process). Raising leaves them unacked, for Redis to redeliver."""

    def on_worker_lost(self, request: Request, reason: str) -> None:
        """Store a final failure for a request that exhausted its retries (main process)."""
        raise NotImplementedError

    def publish_again(self, task_id: str, args: Any, kwargs: Any, retries: int = 0) -> None:
        """Publish a request's message anew under the same task id, stamped with its publish time."""
        stamp = time()
        self.on_publish_again(task_id, stamp)
        self.apply_async(args=args, kwargs=kwargs, task_id=task_id, retries=retries,
                         headers={SENT_AT_HEADER: stamp}, argsrepr=self.describe(args))

    def describe(self, args: Any) -> str:
        """What events, `inspect` and Flower show as the request's arguments (instead of them)."""
        return "(hidden)"

    def on_publish_again(self, task_id: str, stamp: float) -> None:
        """Called just before `publish_again` sends a message stamped `stamp` (main process)."""

    # -- consumer side (main process) ---------------------------------------------------------

    def Strategy(self, task: BatchTask, app: Any, consumer: Any) -> Callable[..., None]:  # noqa: N802
        self._forget_discarded()
        self._pool = consumer.pool
        self._start_renewing(consumer.timer)
        hostname = consumer.hostname
        eventer = consumer.event_dispatcher
        connection_errors = consumer.connection_errors
        request_cls = create_request_cls(symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app)
        revoked_tasks = consumer.controller.state.revoked

        def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> None:
            if body is None and "args" not in message.payload:
                body, headers, decoded, utc = message.body, message.headers, False, app.uses_utc_timezone()
            elif "args" in message.payload:
                body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
            else:
                body, headers, decoded, utc = proto1_to_proto2(message, body)
            req = request_cls(message, on_ack=ack, on_reject=reject, app=app, hostname=hostname, eventer=eventer,
                      task=task, connection_errors=connection_errors, body=body, headers=headers,
                      decoded=decoded, utc=utc)
            if (req.expires or req.id in revoked_tasks) and req.revoked():
                return
            # Whatever the publisher put in `argsrepr` (by default the texts themselves), events,
            # `inspect` and Flower see a description only.
            req._argsrepr = self.describe(req.args)
            signals.task_received.send(sender=consumer, request=req)
            req.time_received = time()  # sent with the request's one event (see _event_fields)
            task_reserved(req)
            try:
                cost = max(1, int(self.cost(req.args, req.kwargs)))
            except Exception:  # malformed arguments: run_batch reports them per request
                cost = 1
            self._enqueue(req, cost)
            self._flush()

        return task_message_handler

    def _forget_discarded(self) -> None:
        """Drop what a lost broker connection took away, when the consumer starts again.

        The pool discards every job it had not yet started (`Consumer.on_close` -> `AsynPool.flush`),
        and a discarded job's callbacks never fire: left in `_in_flight`, such a batch held its slot
        for good, and a one-process worker heartbeated, looked ready and never scored again. The
        buffered requests came from the closed channel, which restored their messages (kombu): they
        will be delivered again, and their old delivery tags can no longer be acked."""
        for batch_id in self._unaccepted:
            self._in_flight.pop(batch_id, None)
        if self._unaccepted or self._buffer:
            logger.warning("consumer restarted: %d batches the pool discarded and %d buffered requests "
                           "dropped; the broker delivers their messages again", len(self._unaccepted),
                           len(self._buffer))
        self._unaccepted.clear()
        self._buffer.clear()

    def _start_renewing(self, timer: Any) -> None:
        """Call `_renew_held` every `renew_every` seconds on the consumer's timer: in the worker's
        event loop (the thread that receives, buffers and acks messages), and only while this main
        process lives (during a warm shutdown Celery goes on firing that timer, from a thread, while
        the pool drains; messages of a channel already closed are skipped, kombu restored them at
        the close). A consumer restart (reconnect) builds
        the strategy again: the old entry is cancelled first, so one timer entry renews, not one per
        reconnect."""
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None
        if self.renew_every > 0 and timer is not None:
            self._renewal = timer.call_repeatedly(self.renew_every, self._renew_held)

    def _held(self) -> list[Request]:
        """Every request whose message this worker holds unacked and will still act on: buffered,
        or in a batch that has not returned. A request left unacked after its batch returned
        (DEFERRED: another batch's lease) is not held: its message must come back, from Redis, one
        visibility timeout later."""
        # Copied first, each in one C-level step: during a warm shutdown Celery fires the event loop's
        # timers from a thread of its own while the pool drains and batches return.
        buffered, batches = list(self._buffer), list(self._in_flight.values())
        return [r for r, _ in buffered] + [r for batch, _ in batches for r in batch]

    def _renew_held(self) -> None:
        """Renew, in the broker's unacked index, the delivery time of every held message (one round
        trip per channel: one, unless a reconnect left requests of the old channel). Without this,
        kombu's restore redelivers any message held longer than the visibility timeout, so that
        timeout had to exceed the longest wait in the buffer plus the slowest batch (120 s), and a
        dead worker's messages waited as long."""
        by_channel: dict[int, tuple[Any, list[str]]] = {}
        for req in self._held():
            message = req.message
            # A closed channel (a lost connection) restored its unacked messages itself when it closed
            # (kombu): they are the broker's to deliver again, not this worker's to keep.
            if not getattr(message.channel, "closed", False):
                by_channel.setdefault(id(message.channel), (message.channel, []))[1].append(message.delivery_tag)
        now = time()
        for channel, tags in by_channel.values():
            try:
                renew_deliveries(channel, tags, now)
            except Exception as exc:  # broker away: the next tick tries again (well inside the timeout)
                logger.warning("could not renew %d held messages in the broker (%r)", len(tags), exc)

    def _is_bulk(self, req: Request) -> bool:
        return (req.delivery_info or {}).get("routing_key") in self.bulk_queues

    def _enqueue(self, req: Request, cost: int) -> None:
        """Buffer a request: one from a bulk queue at the end, any other ahead of every bulk one
        (so the next batch takes interactive work first, whatever bulk work was prefetched)."""
        ahead = len(self._buffer) if self._is_bulk(req) else \
            next((i for i, (r, _) in enumerate(self._buffer) if self._is_bulk(r)), len(self._buffer))
        self._buffer.insert(ahead, (req, cost))

    def _concurrency(self) -> int:
        return int(getattr(self._pool, "num_processes", None) or getattr(self._pool, "limit", 1) or 1)

    def _take(self, budget: int) -> tuple[list[Request], int]:
        """Requests for one pool call and their estimated tokens: up to `budget` (at least one
        request); a retried request alone. A batch never mixes lanes (an interactive request is
        answered when its whole batch is), and bulk work goes at most `bulk_batch_tokens` at a time."""
        bulk = bool(self._buffer) and self._is_bulk(self._buffer[0][0])
        if bulk:
            budget = min(budget, self.bulk_batch_tokens)
        batch: list[Request] = []
        tokens = 0
        while self._buffer:
            req, cost = self._buffer[0]
            retried = req.request_dict.get("retries", 0) > 0
            if batch and (retried or tokens + cost > budget or self._is_bulk(req) != bulk):
                break
            self._buffer.popleft()
            batch.append(req)
            tokens += cost
            if retried:
                break
        return batch, tokens

    def _flush(self) -> None:
        while self._buffer and len(self._in_flight) < self._concurrency():
            # Aim every process at an equal share of all the work in hand (waiting and running):
            # a process freed next to a long batch then takes its share and leaves the rest for
            # the other, instead of the fleet settling into one huge slow batch beside small ones.
            work = sum(cost for _, cost in self._buffer) + sum(tokens for _, tokens in self._in_flight.values())
            self._dispatch(*self._take(min(self.batch_tokens, -(-work // self._concurrency()))))

    def _dispatch(self, batch: list[Request], tokens: int) -> None:
        batch_id = uuid()[:12]
        payload = [{"id": r.id, "args": r.args, "kwargs": r.kwargs, "retries": r.request_dict.get("retries", 0),
                    "sent_at": r.request_dict.get(SENT_AT_HEADER)} for r in batch]
        self._in_flight[batch_id] = (batch, tokens)
        self._unaccepted.add(batch_id)

        def on_accepted(pid: int, time_accepted: float) -> None:
            self._unaccepted.discard(batch_id)
            for r in batch:
                r.worker_pid = pid
                r.time_start = time() - (monotonic() - time_accepted)
                # No task-started event: the STARTED state is stored in the backend anyway, and every
                # event is a publish on the consumer's hot path (Flower lists tasks without it).
                task_accepted(r)

        def on_return(outcomes: list[dict[str, Any]]) -> None:
            self._in_flight.pop(batch_id, None)
            self._unaccepted.discard(batch_id)
            for r, outcome in zip(batch, outcomes, strict=True):
                self._finish(r, outcome)
            self._flush()

        def on_error(einfo: ExceptionInfo) -> None:
            self._in_flight.pop(batch_id, None)
            self._unaccepted.discard(batch_id)
            reason = f"worker process lost while scoring: {einfo.exception!r}"
            logger.error("batch %s failed in the pool (%d requests): %s", batch_id, len(batch), reason,
                         extra={"batch_id": batch_id, "task_ids": [r.id for r in batch]})
            try:
                self.on_batch_lost(batch_id, [r.id for r in batch])
            except Exception:
                logger.exception("batch %s: could not release it; its requests wait for redelivery", batch_id)
                for r in batch:
                    task_ready(r)
                self._flush()
                return
            for r in batch:
                self._retry_or_fail(r, reason)
            self._flush()

        self._pool.apply_async(_run_in_pool, (self.name, batch_id, payload), accept_callback=on_accepted,
                               callback=on_return, error_callback=on_error, correlation_id=batch_id)

    def _finish(self, req: Request, outcome: dict[str, Any]) -> None:
        if outcome["state"] == "DEFERRED":
            logger.info("request %s deferred (%s); left unacked for redelivery", req.id, outcome.get("summary"),
                        extra={"task_id": req.id})
            task_ready(req)
            return
        runtime = outcome.get("runtime", 0.0)
        if outcome["state"] == "FAILURE":
            req.send_event("task-failed", exception=outcome.get("error"), traceback=None, **_event_fields(req))
        else:
            req.send_event("task-succeeded", result=outcome.get("summary", ""), runtime=runtime, **_event_fields(req))
        req.acknowledge()
        task_ready(req, successful=outcome["state"] != "FAILURE")

    def _retry_or_fail(self, req: Request, reason: str) -> None:
        retries = req.request_dict.get("retries", 0)
        try:
            if retries < self.max_retries:
                # Publish the copy before acking the original: a crash in between duplicates the
                # request (the pool side skips requests whose result is already stored), never loses it.
                self.publish_again(req.id, req.args, req.kwargs, retries + 1)
                req.send_event("task-retried", exception=reason, **_event_fields(req))
            else:
                self.on_worker_lost(req, f"{reason}; gave up after {retries + 1} attempts")
                req.send_event("task-failed", exception=reason, traceback=None, **_event_fields(req))
            req.acknowledge()
        except Exception:
            # Broker or backend unreachable: leave the message unacked; Redis redelivers it after the
            # visibility timeout, so it is delayed, not lost.
            logger.exception("could not re-publish or fail request %s; leaving it for redelivery", req.id,
                             extra={"task_id": req.id})
        task_ready(req)


def _event_fields(req: Request) -> dict[str, Any]:
    """What a task-received event would have told Flower, for the request's one event."""
    return {"name": req.name, "args": req.argsrepr, "kwargs": req.kwargsrepr,
            "retries": req.request_dict.get("retries", 0), "received": getattr(req, "time_received", None)}
