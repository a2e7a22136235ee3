"""Python client for the toxfleet HTTP API: `Client` (blocking) and `AsyncClient` (asyncio).

    from toxfleet.client import Client

    with Client("http://localhost:8000", api_key=None) as tf:
        job = tf.submit(["you are lovely", "you are an idiot"])   # 202: queued
        status = job.wait(timeout=30)                            # long-polls until done
        for r in status.results:
            print(r.flagged, r["toxicity"], r.labels)
        results = tf.score(texts)                                # any size: split, pipelined, in order

Needs only httpx (no torch, no Celery). Submits carry an `Idempotency-Key`, so a submit retried after
a lost connection never creates a second job. `429` and `503` are retried after the `Retry-After` the
server sends (else with exponential backoff) until `retry_for` seconds are spent, then
`Unavailable` is raised. Waiting uses the server's long-poll (`?wait=`), so a finished job is seen
at once without polling in a loop. A job the broker loses after its `202` (it answers 404, or makes
no progress for `stall_after` seconds while `/readyz` reports workers) is submitted again by
`wait()`, under the same Idempotency-Key: `score` returns every result once, in order.
"""


from toxfleet.client.aio import AsyncClient, AsyncJob
from toxfleet.client.blocking import Client, Job
from toxfleet.client.protocol import (
    DEFAULT_IN_FLIGHT,
    DEFAULT_JOB_CHARS,
    DEFAULT_JOB_SIZE,
    DEFAULT_POLL_WAIT,
    DEFAULT_RETRY_FOR,
    DEFAULT_STALL_AFTER,
    DEFAULT_TIMEOUT,
    split,
)
from toxfleet.client.results import (
    APIError,
    BatchOutcome,
    InvalidRequest,
    JobFailed,
    JobNotFound,
    JobStatus,
    JobTimeout,
    Result,
    ToxfleetError,
    Unauthorized,
    Unavailable,
)

__all__ = [
    "DEFAULT_IN_FLIGHT", "DEFAULT_JOB_CHARS", "DEFAULT_JOB_SIZE", "DEFAULT_POLL_WAIT", "DEFAULT_RETRY_FOR",
    "DEFAULT_STALL_AFTER", "DEFAULT_TIMEOUT",
    "APIError", "AsyncClient", "AsyncJob", "BatchOutcome", "Client", "InvalidRequest", "Job",
    "JobFailed", "JobNotFound", "JobStatus", "JobTimeout", "Result", "ToxfleetError", "Unauthorized", "Unavailable",
    "split",
]
