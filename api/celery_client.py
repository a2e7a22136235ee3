"""The API's Celery app: a client only. It sends score tasks by name and never imports worker code."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.redis import RedisBackend, SentinelBackend

from api.settings import ApiSettings
from toxfleet import contract
from toxfleet.celeryconf import celery_config
from toxfleet.redis_url import celery_target


class SendOnlyRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend, minus the subscription it opens for every task sent.

    `send_task` subscribes the sender to the task's result channel so that `AsyncResult.get()` can
    wait on it, and unsubscribes when the result object is collected: two commands per message on a
    pub/sub connection per thread, whose confirmations nobody reads, and redis-py's PubSub keeps every
    channel name until it reads one, so memory grows with every job. The API never calls `.get()`; it
    reads result keys itself and waits with its own shared subscription (`api.waiter`)."""

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None


class SendOnlySentinelBackend(SentinelBackend):  # type: ignore[misc]
    """`SendOnlyRedisBackend` over Redis Sentinel."""

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None


def make_celery(settings: ApiSettings) -> Celery:
    """A client-only Celery app: it sends tasks by name and never imports worker code."""
    # "<class>+<url>" is Celery's own syntax for a backend class with a URL.
    target = celery_target(settings.redis_url)
    cls = SendOnlySentinelBackend if target.sentinel else SendOnlyRedisBackend
    backend = f"{cls.__module__}:{cls.__qualname__}+{target.url}"
    app = Celery("toxfleet-api", broker=target.url, backend=backend, set_as_current=False)
    app.conf.update(
        celery_config(visibility_timeout=settings.visibility_timeout, result_expires=settings.result_expires,
                      redis_url=settings.redis_url),
        # Fail fast when Redis is away: the client gets a 503 and retries, instead of a hung request.
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
        broker_connection_timeout=settings.redis_timeout,
        broker_connection_max_retries=1,
    )
    return app


def send_chunks(celery: Celery, job_id: str, chunks: list[list[str]], kwargs: dict[str, str] | None,
                sent_at: float, queue: str = contract.QUEUE) -> None:
    """Publish a job's task messages over one producer (blocking: run it in a thread)."""
    headers = {contract.SENT_AT_HEADER: sent_at}  # workers measure queue wait from it
    with celery.producer_or_acquire() as producer:
        for i, texts in enumerate(chunks):
            celery.send_task(contract.SCORE_TASK, args=[texts], kwargs=kwargs,
                             task_id=contract.chunk_task_id(job_id, i), producer=producer, headers=headers, queue=queue,
                             argsrepr=contract.args_summary([texts]))
