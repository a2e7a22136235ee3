"""The worker's Celery app: `celery -A worker worker` finds it as `worker.app`.

Importing this is cheap (no torch): the model is loaded per pool process by `worker.lifecycle`
(into `worker.state`).
"""

from __future__ import annotations

from celery import Celery
from kombu.entity import Exchange, Queue

from fleet.celeryconf import celery_config
from fleet.redis_url import celery_target
from toxfleet import contract
from worker.cpus import default_concurrency
from worker.settings import get_settings

_settings = get_settings()

_broker = celery_target(_settings.redis_url).url  # a Sentinel URL in Celery's spelling

app = Celery("toxfleet", broker=_broker, backend=_broker,
             include=["worker.tasks", "worker.lifecycle", "worker.metrics"])
app.conf.update(
    celery_config(visibility_timeout=_settings.visibility_timeout, result_expires=_settings.result_expires,
                  redis_url=_settings.redis_url),
    # Results are written per request by the batch itself; late acks come after that write.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # Buffered requests are unacked and count against prefetch; it must cover a full batch per
    # process plus the one being buffered, or batches never fill.
    worker_prefetch_multiplier=_settings.prefetch_multiplier,
    worker_concurrency=_settings.concurrency or default_concurrency(_settings.torch_threads),
    worker_send_task_events=True,
    # Both lanes, interactive first: with the "priority" queue order (fleet.celeryconf) the
    # worker always drains the interactive queue before it reads the bulk one.
    task_queues=[Queue(q, Exchange(q), routing_key=q) for q in contract.QUEUES],  # type: ignore[no-untyped-call]
    # Pool processes load the model in worker_process_init; billiard's default of 4 s for a new
    # process to report "up" is shorter than a model load on a busy host, and it kills them in a loop.
    worker_proc_alive_timeout=_settings.process_start_timeout,
    worker_hijack_root_logger=True,
)
