"""The API's Celery app: a client only. It sends score tasks by name and never imports worker code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from celery import Celery
from celery.backends.redis import RedisBackend, SentinelBackend
from starlette.concurrency import run_in_threadpool

from api.coalescer import Coalescer
from api.settings import ApiSettings
from fleet.celeryconf import celery_config
from fleet.redis_url import celery_target
from toxfleet import contract


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
    backend = f"{cls.__module__}:{cls.__qualname__}+{target.backend_url}"
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


class Messages(NamedTuple):
    """One job's task messages: a message per chunk, with task ids derived from the job id."""

    job_id: str
    chunks: list[list[str]]
    kwargs: dict[str, str] | None
    sent_at: float
    queue: str = contract.QUEUE


def send_messages(celery: Celery, jobs: Sequence[Messages]) -> None:
    """Publish the task messages of `jobs` over one producer, in one Redis round trip where the
    transport can batch (kombu's `Producer.batch`: a non-transactional pipeline, flushed on exit;
    without it, one LPUSH each). Blocking: run it in a thread.

    Nothing is declared (`declare=[]`): Celery otherwise declares the target queue on every send,
    through kombu's cached `maybe_declare`, whose retry wrapper alone costs every job. A task goes to
    its queue by name (the default exchange, routing key = queue), which on Redis needs no binding,
    and the workers declare the queues they consume."""
    with celery.producer_or_acquire() as producer, producer.batch():
        for job in jobs:
            headers = {contract.SENT_AT_HEADER: job.sent_at}  # workers measure queue wait from it
            for i, texts in enumerate(job.chunks):
                celery.send_task(contract.SCORE_TASK, args=[texts], kwargs=job.kwargs,
                                 task_id=contract.chunk_task_id(job.job_id, i), producer=producer,
                                 headers=headers, queue=job.queue, argsrepr=contract.args_summary([texts]),
                                 declare=[])


class Publisher:
    """Sends the messages of concurrent submits together (`api.coalescer`): one thread hop, one
    producer and one Redis round trip for every job whose submit arrived while the previous send was
    in flight, so that each job pays a share of those fixed costs. A failed send fails every submit of
    its group, each of which then answers 503 and forgets its job."""

    def __init__(self, celery: Celery) -> None:
        self._celery = celery
        self._sends: Coalescer[Messages, None] = Coalescer(self._send_group)

    async def send(self, job: Messages) -> None:
        """Return once `job`'s messages are in Redis; raises what the send raised."""
        await self._sends(job)

    @property
    def sends(self) -> int:
        """Sends so far (each one thread hop and one round trip), for tests and benchmarks."""
        return self._sends.groups

    async def _send_group(self, jobs: list[Messages]) -> list[None]:
        await run_in_threadpool(send_messages, self._celery, jobs)
        return [None] * len(jobs)
