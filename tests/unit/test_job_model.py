"""One job shape. The API's `Job` is what the read service builds and `GET /v1/jobs/{id}` returns; the
client (which cannot import api/) keeps a dataclass of its own that parses the same JSON. These tests
fail when the two drift: a field added to one and not the other, or one the client reads wrongly."""

from __future__ import annotations

import dataclasses
import typing

from api.routes.jobs import get_job
from api.schemas import Job, JobAccepted, JobRequest
from toxfleet import contract
from toxfleet.client.protocol import parse_job
from toxfleet.client.results import JobStatus, Result

FOLDED = {"progress": {"done", "total"}, "flags": set()}
"""API fields the client spreads out: `progress` becomes `done`/`total`; each text's `flags` go into
its `Result` (`flagged`, `labels`)."""


def _a_job(**changes: object) -> Job:
    """A succeeded job with every field set to a value unlike its default."""
    fields: dict[str, object] = dict(
        id="ab" * 16, status="succeeded", progress={"done": 2, "total": 2}, model="unbiased-small", error=None,
        results=[{"toxicity": 0.9, "threat": 0.1}, {"toxicity": 0.2, "threat": 0.7}],
        flags=[{"flagged": True, "labels": {"toxicity": True, "threat": False}},
               {"flagged": True, "labels": {"toxicity": False, "threat": True}}],
        cache_hits=1, created_at="2030-01-01T00:00:00.000Z", started_at="2030-01-01T00:00:01.000Z",
        finished_at="2030-01-01T00:00:02.000Z", expires_at="2030-01-02T00:00:00.000Z")
    fields.update(changes)
    return Job.model_validate(fields)


def test_the_client_has_a_field_for_every_field_of_the_api_job() -> None:
    """The client's JobStatus holds exactly the API Job's fields, `progress` and `flags` folded in."""
    expected = set(Job.model_fields) - set(FOLDED)
    for parts in FOLDED.values():
        expected |= parts
    assert {f.name for f in dataclasses.fields(JobStatus)} == expected


def test_the_client_reads_every_field_the_api_sends() -> None:
    """The JSON the route sends, parsed by the client, carries each value through."""
    job = _a_job()
    status = parse_job(job.model_dump(mode="json"))
    assert status.results == [Result(r, f.flagged, f.labels) for r, f in zip(job.results or [], job.flags or [],
                                                                              strict=True)]
    assert (status.done, status.total) == (job.progress.done, job.progress.total)
    for name in set(Job.model_fields) - set(FOLDED) - {"results"}:
        assert getattr(status, name) == getattr(job, name), name
    failed = parse_job(_a_job(status="failed", results=None, flags=None, error="chunk 1 of 2: boom").model_dump(
        mode="json"))
    assert failed.error == "chunk 1 of 2: boom" and failed.results is None and failed.finished


def test_job_states_and_request_choices_are_the_contracts() -> None:
    """The API's status, long_text and priority types are the contract's, and API and client agree on
    which states are final."""
    assert typing.get_args(Job.model_fields["status"].annotation) == contract.JOB_STATES
    assert typing.get_args(JobAccepted.model_fields["status"].annotation) == contract.JOB_STATES
    assert typing.get_args(JobRequest.model_fields["long_text"].annotation) == contract.LONG_TEXT_MODES
    assert typing.get_args(JobRequest.model_fields["priority"].annotation) == contract.PRIORITIES
    for state in contract.JOB_STATES:
        job = _a_job(status=state)
        assert parse_job(job.model_dump(mode="json")).finished == job.finished == (state in {"succeeded", "failed"})


def test_the_route_returns_the_services_model() -> None:
    """The route's response model is the class the read service returns, not a copy of it."""
    hints = typing.get_type_hints(get_job)
    assert hints["return"] is Job
    from api.services.read import ReadService

    assert typing.get_type_hints(ReadService.get)["return"] is Job
