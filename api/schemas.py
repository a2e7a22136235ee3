"""HTTP shapes of the API (request bodies and responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from toxfleet.contract import FINISHED_STATES, LABELS, JobState, LongText, Priority
from toxfleet.thresholds import check_labels, check_threshold

JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
"""Job ids are UUID4 hex strings; anything else is rejected before Redis is asked."""

_PROBABILITY = {"type": "number", "minimum": 0, "maximum": 1}
ThresholdsField = Annotated[float | dict[str, float] | None, WithJsonSchema({"anyOf": [
    _PROBABILITY, {"type": "object", "propertyNames": {"enum": list(LABELS)}, "additionalProperties": _PROBABILITY},
    {"type": "null"}]})]
"""A request's thresholds, as the schema states what `JobRequest._thresholds` accepts: one number in
[0, 1], or {label: number in [0, 1]} with known labels (never `true` or `"0.5"`)."""


class JobRequest(BaseModel):
    texts: list[str] = Field(min_length=1, description="Texts to score, scored independently, results in order.")
    long_text: LongText = Field(
        "truncate", description="Texts longer than the model reads (512 tokens): `truncate` scores the start only "
        "(Detoxify's behaviour); `windows` scores overlapping 512-token windows and takes each label's max "
        "(costs one forward pass per window; see docs/client.md).")
    priority: Priority = Field(
        "interactive", description="`interactive` (default): workers take it before any bulk work; `bulk`: "
        "backfills, scored when no interactive work waits (the Python client's `score` and `toxfleet score` "
        "send this).")
    thresholds: ThresholdsField = Field(
        None, description="Flag thresholds for this job: one probability for every label, or {label: probability} "
        "overriding the configured ones; default: the configured thresholds (0.5 unless set).")

    @field_validator("thresholds", mode="before")
    @classmethod
    def _numbers_only(cls, value: Any) -> Any:
        """JSON numbers only: pydantic would otherwise read `true` as 1.0 and `"0.5"` as 0.5."""
        values = value.values() if isinstance(value, dict) else [value]
        if value is not None and any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
            raise ValueError("thresholds: a number in [0, 1], or {label: number in [0, 1]}")
        return value

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, value: float | dict[str, float] | None) -> float | dict[str, float] | None:
        if isinstance(value, dict):
            return check_labels(value, "thresholds")
        return None if value is None else check_threshold(value, "thresholds")


class JobAccepted(BaseModel):
    id: str
    status: JobState = Field("queued", description="`succeeded` when the score cache answered every text at once.")
    url: str = Field(description="Where to GET the job (same as the Location header).")


class Progress(BaseModel):
    done: int = Field(description="Texts scored so far.")
    total: int


class Flags(BaseModel):
    flagged: bool = Field(description="Whether any label is at or above its threshold.")
    labels: dict[str, bool] = Field(description="Per label: at or above its threshold.")


# The one job model: `api.services.read.ReadService` builds it and `GET /v1/jobs/{id}` returns it; the
# client's `toxfleet.client.JobStatus` parses its JSON (tests/unit/test_job_model.py keeps them together).
class Job(BaseModel):
    """A job: its status and progress, and its results once succeeded."""

    id: str
    status: JobState
    results: list[dict[str, float]] | None = Field(
        description="One {label: probability} per text, in input order, once succeeded; else null.")
    model: str | None = Field(description="The model that scored the job, once known.")
    error: str | None = Field(description="Why the job failed; null unless failed.")
    progress: Progress
    flags: list[Flags] | None = Field(
        None, description="Parallel to `results`: per text, the thresholded decision; null until succeeded.")
    cache_hits: int = Field(0, description="Texts answered from the score cache so far, without the model.")
    created_at: str | None = Field(None, description="When the job was submitted (RFC 3339, UTC).")
    started_at: str | None = Field(None, description="When a worker started on it (RFC 3339, UTC); null until then.")
    finished_at: str | None = Field(None, description="When its last result was stored; null until finished.")
    expires_at: str | None = Field(None, description="When the job and its results are forgotten (404 after).")

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATES


class Problem(BaseModel):
    """An RFC 9457 problem (served as `application/problem+json`)."""

    type: str = Field(description="Stable URI naming the problem, e.g. `/problems/queue-full`.")
    title: str
    status: int
    detail: str
    errors: list[dict[str, object]] | None = Field(None, description="A 422's field errors (`loc`, `msg`, `type`).")


def problem_responses(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route's error statuses, each an `application/problem+json` Problem.
    Naming 422 here also replaces FastAPI's own `HTTPValidationError` entry, which is not what a 422 is."""
    content = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    return {code: {"description": text, "model": Problem, "content": content} for code, text in descriptions.items()}


VALIDATION = "`/problems/validation`: a field is missing, mistyped or over a limit (field errors in `errors`)"
UNAUTHORIZED = "`/problems/unauthorized`: API keys are on: send `Authorization: Bearer <key>`"
BODY_TOO_LARGE = "`/problems/body-too-large`"
OVERLOADED = "`/problems/queue-full`, `/problems/api-busy` or `/problems/rate-limited`; see Retry-After"
UNAVAILABLE = "`/problems/broker-unavailable` or `/problems/not-replicated`; see Retry-After"


class Health(BaseModel):
    status: str


class GateFigures(BaseModel):
    """The fidelity gate's row for the backend `auto` chose (docs/backends.md)."""

    max_abs: float | None = Field(None, description="Largest absolute probability difference from torch fp32.")
    p99_abs: float | None = Field(None, description="99th percentile of the absolute differences.")
    flips_pct: float | None = Field(None, description="Texts (%) with a decision changed at the worst threshold.")
    min_spearman: float | None = Field(None, description="Lowest per-label rank agreement (reference >= 0.05).")
    texts_per_s: float | None = Field(None, description="Gate throughput of this backend on the deciding machine.")
    decided_at: float | None = Field(None, description="When the gate decided (unix time).")


class RuntimeGate(BaseModel):
    """The runtime fidelity gate for a worker's kind of CPU (`auto` without a decision; docs/backends.md)."""

    model_config = ConfigDict(extra="allow")

    state: str | None = Field(None, description="starting, waiting (another worker gates), gating (this one "
                                                "does), exporting, backoff (after a failure), decided, unavailable "
                                                "(Redis away).")
    key: str | None = Field(None, description="The decision key (checkpoint, int8 recipe, CPU kind, versions).")
    holder: str | None = Field(None, description="The worker process that holds the gate lock.")
    progress: str | None = Field(None, description="The gate's last progress line.")
    attempts: int | None = Field(None, description="Failed gates so far for this key.")
    retry_at: float | None = Field(None, description="When the next gate may start (unix time).")
    last_error: str | None = Field(None, description="Why the last gate failed.")


class WorkerBackend(BaseModel):
    hostname: str
    model: str | None
    backend: str | None = Field(description="The backend this worker runs.")
    gate: GateFigures | None = Field(description="The gate figures behind it when `auto` chose it; "
                                                 "null for a backend set by name or `auto` without a decision.")
    why: str | None = Field(None, description="Why this backend: set by name, the gate's decision, or why `auto` "
                                              "runs the reference (null from older workers).")
    gating: RuntimeGate | None = Field(None, description="The runtime gate for this worker's kind of CPU; null "
                                                         "when it has nothing to gate.")


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"]
    broker: Literal["ok", "unreachable"]
    workers: int = Field(description="Workers whose heartbeat is recent.")
    models: list[str] = Field(description="Models the answering workers run.")
    queue_depth: int | None
    backends: list[WorkerBackend] = Field(default_factory=list,
                                          description="Per answering worker: the backend it runs and why.")
