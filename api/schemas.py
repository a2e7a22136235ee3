"""HTTP shapes of the API (request bodies and responses)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
"""Job ids are UUID4 hex strings; anything else is rejected before Redis is asked."""

JobStatus = Literal["queued", "running", "succeeded", "failed"]


class JobRequest(BaseModel):
    texts: list[str] = Field(min_length=1, description="Texts to score, scored independently, results in order.")


class JobAccepted(BaseModel):
    id: str
    status: JobStatus = "queued"
    url: str = Field(description="Where to GET the job (same as the Location header).")


class Progress(BaseModel):
    done: int = Field(description="Texts scored so far.")
    total: int


class Job(BaseModel):
    id: str
    status: JobStatus
    results: list[dict[str, float]] | None = Field(
        description="One {label: probability} per text, in input order, once succeeded; else null.")
    model: str | None = Field(description="The model that scored the job, once known.")
    error: str | None = Field(description="Why the job failed; null unless failed.")
    progress: Progress


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"]
    broker: Literal["ok", "unreachable"]
    workers: int = Field(description="Workers whose heartbeat is recent.")
    models: list[str] = Field(description="Models the answering workers run.")
    queue_depth: int | None
