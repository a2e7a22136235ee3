"""`/v1/jobs`: submit texts (202 + Location), then GET the job, optionally long-polling with `?wait=`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.exceptions import RequestValidationError

from api.deps import CallerDep
from api.schemas import (
    BODY_TOO_LARGE,
    JOB_ID_PATTERN,
    OVERLOADED,
    UNAUTHORIZED,
    UNAVAILABLE,
    VALIDATION,
    Job,
    JobAccepted,
    JobRequest,
    problem_responses,
)
from api.settings import ApiSettings
from toxfleet import contract

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_ERRORS = problem_responses({
    401: UNAUTHORIZED,
    404: "`/problems/not-found`: unknown, expired or deleted job",
    413: BODY_TOO_LARGE,
    422: VALIDATION + ", or `/problems/idempotency-mismatch`",
    429: OVERLOADED,
    503: UNAVAILABLE,
})


def check_texts(texts: list[str], settings: ApiSettings, loc: tuple[str, ...] = ("body", "texts")) -> None:
    """Enforce the configured limits with the same 422 shape FastAPI uses for schema errors."""
    if len(texts) > settings.max_texts:
        raise RequestValidationError([{"type": "too_long", "loc": loc, "input": len(texts),
                                       "msg": f"at most {settings.max_texts} texts per job, got {len(texts)}"}])
    for i, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise RequestValidationError([{"type": "string_too_long", "loc": (*loc, i), "input": len(text),
                                           "msg": f"at most {settings.max_text_chars} characters per text, "
                                                  f"got {len(text)}"}])
        if not contract.is_unicode(text):
            raise RequestValidationError([{"type": "string_unicode", "loc": (*loc, i), "input": None,
                                           "msg": "not valid Unicode: contains a lone surrogate "
                                                  "(U+D800-U+DFFF not in a pair)"}])


@router.post("", status_code=202, response_model=JobAccepted, responses=_ERRORS)
async def submit_job(
    body: JobRequest,
    response: Response,
    caller: CallerDep,
    idempotency_key: Annotated[str | None, Header(
        min_length=1, max_length=255,
        description="Retrying with the same key returns the same job while it exists (the key is remembered "
                    "for `TOXFLEET_IDEMPOTENCY_TTL`; after that, or once the job is deleted or expired, the key "
                    "starts a new job); the same key with a different body is 422.")] = None,
) -> JobAccepted:
    """Enqueue texts for scoring; poll the Location it returns."""
    settings = caller.settings
    check_texts(body.texts, settings)
    thresholds = settings.base_thresholds.override(body.thresholds)
    job_id, created, status = await caller.services.submit.submit(
        body.texts, idempotency_key, fingerprint=body.model_dump_json(), long_text=body.long_text,
        thresholds=thresholds, owner=caller.key, priority=body.priority)
    url = f"/v1/jobs/{job_id}"
    response.headers["Location"] = url
    response.headers["Retry-After"] = str(settings.retry_after)
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    return JobAccepted(id=job_id, url=url, status=status)  # type: ignore[arg-type]


@router.delete("/{job_id}", status_code=204, response_class=Response, responses=_ERRORS)
async def delete_job(
    job_id: Annotated[str, Path(pattern=JOB_ID_PATTERN, description="The id `POST /v1/jobs` returned.")],
    caller: CallerDep,
) -> Response:
    """Forget the job: a later GET is 404, and workers skip its texts not yet scored."""
    await caller.services.submit.delete(job_id, owner=caller.key)
    return Response(status_code=204)


@router.get("/{job_id}", response_model=Job, responses=_ERRORS)
async def get_job(
    job_id: Annotated[str, Path(pattern=JOB_ID_PATTERN, description="The id `POST /v1/jobs` returned.")],
    response: Response,
    caller: CallerDep,
    wait: Annotated[float, Query(ge=0, description="Seconds to wait for the job to finish (long-poll).")] = 0,
) -> Job:
    """The job's status, and its results once succeeded."""
    settings = caller.settings
    if wait > settings.max_wait:
        raise RequestValidationError([{"type": "less_than_equal", "loc": ("query", "wait"), "input": wait,
                                       "msg": f"wait must be at most {settings.max_wait} seconds"}])
    view = await caller.services.read.get(job_id, wait=wait, owner=caller.key)
    if not view.finished:
        response.headers["Retry-After"] = str(settings.retry_after)
    return view
