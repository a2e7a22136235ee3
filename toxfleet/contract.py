"""What the API and the workers agree on, and nothing else.

The API sends tasks *by name* and never imports worker code (which would pull in torch), so this
module is the whole interface between the tiers: the task name and queue, the shape of a task's
arguments and result, and the defaults of the limits both sides enforce. Stdlib only.

Task `toxfleet.score` (queue `toxfleet` for interactive work, `toxfleet.bulk` for bulk work)
    args:   `[texts]`, a list of strings.
    kwargs: optional `long_text`: `"truncate"` (the default, exactly Detoxify's behaviour) or
            `"windows"` (see `LONG_TEXT_MODES`); no other keyword is accepted.
    result: a list, one `{label: probability}` dict per text, in input order.
    The stored result meta also carries `model` (the identity of the model that scored it) and
    `cache_hits` (texts answered from the score cache), which `AsyncResult.get()` ignores and the
    API reports.
    headers: optional `toxfleet_sent_at` (`SENT_AT_HEADER`), the unix time the API published the
    message, from which workers measure queue wait; callers that omit it are scored all the same.
"""

from __future__ import annotations

from typing import Literal, get_args

from toxfleet.chunking import split

SCORE_TASK = "toxfleet.score"
"""Name of the scoring task; callers use `app.send_task(SCORE_TASK, args=[texts])`."""

QUEUE = "toxfleet"
"""Queue of interactive scoring work (a dedicated one, so a shared Redis stays tidy); a task sent
without a queue is routed here."""

BULK_QUEUE = "toxfleet.bulk"
"""Queue of bulk scoring work (backfills): workers take it only when no interactive work waits."""

Priority = Literal["interactive", "bulk"]
"""A job's `priority`: the lane its messages travel in (the API's request field reads this type)."""

PRIORITIES: tuple[Priority, ...] = get_args(Priority)
INTERACTIVE: Priority = "interactive"
BULK: Priority = "bulk"

JobState = Literal["queued", "running", "succeeded", "failed"]
"""A job's `status` as the API reports it (and the client reads it)."""

JOB_STATES: tuple[JobState, ...] = get_args(JobState)
FINISHED_STATES: tuple[JobState, ...] = ("succeeded", "failed")
"""The states a job leaves no more."""

QUEUES = (QUEUE, BULK_QUEUE)
"""Every queue workers consume, most urgent first (the order they read them in)."""


def queue_for(priority: str) -> str:
    """The queue a job of this priority is sent to (`send_task(..., queue=queue_for(...))`)."""
    return BULK_QUEUE if priority == BULK else QUEUE


MAX_TEXTS_PER_JOB = 1_000
"""Default cap on texts in one HTTP job or one direct task call."""

MAX_TEXT_CHARS = 20_000
"""Default cap on characters per text (the model reads at most 512 tokens, about 2,000 characters)."""


def is_unicode(text: str) -> bool:
    """Whether a text is valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which UTF-8,
    Redis clients and the tokenizer all refuse, so the API answers 422 and the worker fails the request."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


CHUNK_TOKENS = 512
"""Estimated tokens per task message when the API splits a job (see `estimate_tokens`)."""

CHUNK_TEXTS = 8
"""Most texts per task message when the API splits a job: large jobs become many messages, so
several workers share them and small jobs are not stuck behind one long message."""

MODEL_MAX_TOKENS = 512
"""Longest input the Detoxify models read; longer texts are truncated."""


LongText = Literal["truncate", "windows"]
"""The task's `long_text` keyword (and the HTTP request field of the same name, which reads this type)."""

LONG_TEXT_MODES: tuple[LongText, ...] = get_args(LongText)

TRUNCATE: LongText = "truncate"
"""`long_text` mode: score the first `MODEL_MAX_TOKENS` tokens only (Detoxify's own behaviour)."""

WINDOWS: LongText = "windows"
"""`long_text` mode: score overlapping windows of the model's length; each label is the max over them."""

WINDOW_OVERLAP_TOKENS = 128
"""Tokens shared by consecutive windows, so a phrase of up to this many tokens that straddles a
window boundary is still read whole by one window. Fixed here (not a setting) because it is part of
what a windowed score means, and so of the score cache's key."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Histogram buckets (seconds) of every latency both tiers export (HTTP requests, queue wait,
inference), so that one dashboard compares their quantiles on the same edges."""

LABELS = ("toxicity", "severe_toxicity", "obscene", "identity_attack", "insult", "threat", "sexual_explicit")
"""Every label a Detoxify model returns (`original` returns the first six, `unbiased` and
`multilingual` all seven); thresholds may only name these."""


def args_summary(args: object) -> str:
    """What logs, Celery events and Flower show of a task's arguments: how many texts, never the texts
    (pass it as `send_task(..., argsrepr=...)`; workers also put it in every event whatever was sent)."""
    texts = args[0] if isinstance(args, list | tuple) and args else None
    return f"{len(texts)} texts" if isinstance(texts, list | tuple) else "invalid arguments"


def window_starts(length: int, size: int, overlap: int = WINDOW_OVERLAP_TOKENS) -> list[int]:
    """Where the windows over `length` content tokens start: every window holds `size` tokens (the
    last one is aligned to the end rather than left short), consecutive ones share at least
    `overlap`. A text that fits gives `[0]`, so windows mode then equals truncate mode exactly."""
    if size <= overlap:
        raise ValueError("window size must exceed the overlap")
    if length <= size:
        return [0]
    return [*range(0, length - size, size - overlap), length - size]


def estimate_tokens(text: str, long_text: str = TRUNCATE) -> int:
    """Cheap token estimate for scheduling (no tokenizer in the API): about 4 characters a token,
    plus the two special tokens, capped at what the model reads; in windows mode, what all the
    windows read."""
    content = (len(text) + 3) // 4
    if long_text == WINDOWS and content > MODEL_MAX_TOKENS - 2:
        return MODEL_MAX_TOKENS * len(window_starts(content, MODEL_MAX_TOKENS - 2))
    return min(MODEL_MAX_TOKENS, 2 + content)


def chunk(texts: list[str], max_tokens: int = CHUNK_TOKENS, max_texts: int = CHUNK_TEXTS,
          long_text: str = TRUNCATE) -> list[list[str]]:
    """Split a job's texts into task messages, in order, each within both budgets (a single text
    over the token budget still forms a chunk of its own)."""
    return list(split(texts, lambda text: estimate_tokens(text, long_text), max_tokens, max_texts))


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
