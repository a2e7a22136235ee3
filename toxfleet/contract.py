"""What the API and the workers agree on, and nothing else.

The API sends tasks *by name* and never imports worker code (which would pull in torch), so this
module is the whole interface between the tiers: the task name and queue, the shape of a task's
arguments and result, and the defaults of the limits both sides enforce. Stdlib only.

Task `toxfleet.score`
    args:   `[texts]`, a list of strings.
    result: a list, one `{label: probability}` dict per text, in input order.
    The stored result meta also carries `model` (the identity of the model that scored it), which
    `AsyncResult.get()` ignores and the API reports.
    headers: optional `toxfleet_sent_at` (`SENT_AT_HEADER`), the unix time the API published the
    message, from which workers measure queue wait; callers that omit it are scored all the same.
"""

from __future__ import annotations

SCORE_TASK = "toxfleet.score"
"""Name of the scoring task; callers use `app.send_task(SCORE_TASK, args=[texts])`."""

QUEUE = "toxfleet"
"""Queue the scoring task is routed to (a dedicated one, so a shared Redis stays tidy)."""

RUNNING_STATE = "STARTED"
"""Celery state a worker stores for every request of a batch as the batch starts."""

MAX_TEXTS_PER_JOB = 1_000
"""Default cap on texts in one HTTP job or one direct task call."""

MAX_TEXT_CHARS = 20_000
"""Default cap on characters per text (the model reads at most 512 tokens, about 2,000 characters)."""

CHUNK_TOKENS = 1_024
"""Estimated tokens per task message when the API splits a job (see `estimate_tokens`)."""

CHUNK_TEXTS = 16
"""Most texts per task message when the API splits a job: large jobs become many messages, so
several workers share them and small jobs are not stuck behind one long message."""

MODEL_MAX_TOKENS = 512
"""Longest input the Detoxify models read; longer texts are truncated."""


def estimate_tokens(text: str) -> int:
    """Cheap token estimate for scheduling (no tokenizer in the API): about 4 characters a token,
    plus the two special tokens, capped at what the model reads."""
    return min(MODEL_MAX_TOKENS, 2 + (len(text) + 3) // 4)


def chunk(texts: list[str], max_tokens: int = CHUNK_TOKENS, max_texts: int = CHUNK_TEXTS) -> list[list[str]]:
    """Split a job's texts into task messages, in order, each within both budgets (a single text
    over the token budget still forms a chunk of its own)."""
    chunks: list[list[str]] = []
    current: list[str] = []
    tokens = 0
    for text in texts:
        cost = estimate_tokens(text)
        if current and (tokens + cost > max_tokens or len(current) >= max_texts):
            chunks.append(current)
            current, tokens = [], 0
        current.append(text)
        tokens += cost
    if current:
        chunks.append(current)
    return chunks


def chunk_task_id(job_id: str, index: int) -> str:
    """Celery task id of a job's `index`-th chunk; derived, so the API needs no lookup table."""
    return f"{job_id}.{index}"


def job_of(task_id: str) -> str:
    """The job a task id belongs to: the inverse of `chunk_task_id`; a task sent directly to Celery
    (no job) is its own job."""
    job_id, dot, index = task_id.rpartition(".")
    return job_id if dot and index.isdigit() else task_id


SENT_AT_HEADER = "toxfleet_sent_at"
"""Message header: unix time (float seconds) at which the API published the task message."""

UNACKED_KEY = "unacked"
"""Redis hash in which kombu keeps messages delivered to a worker and not yet acknowledged (kombu's
default `unacked_key`): with late acks, every message a worker has buffered or is scoring."""


WORKERS_KEY = "toxfleet:workers"
"""Redis sorted set: worker hostname -> unix time of its last heartbeat."""

WORKER_INFO_PREFIX = "toxfleet:worker:"
"""Redis key prefix of a worker's JSON description (model, backend, concurrency), expiring."""

HEARTBEAT_STALE_SECONDS = 15
"""A worker whose last heartbeat is older than this is not counted as answering."""
