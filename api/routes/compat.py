"""Drop-in replacements for the endpoints of the service toxfleet replaces, same response shapes.

They ride on the same queue and workers, and wait for the result (up to `compat_timeout`), so an
existing client keeps working unchanged while the work is batched behind it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from api.deps import Caller, CallerDep
from api.errors import ScoringFailed, ScoringTimeout
from api.routes.jobs import check_texts
from api.schemas import BODY_TOO_LARGE, OVERLOADED, UNAUTHORIZED, UNAVAILABLE, VALIDATION, problem_responses
from api.services.submit import new_job_id
from toxfleet import contract

router = APIRouter(tags=["compatibility"])

_ERRORS = problem_responses({
    401: UNAUTHORIZED,
    413: BODY_TOO_LARGE,
    422: VALIDATION,
    429: OVERLOADED,
    502: "`/problems/scoring-failed`: the job failed in the workers",
    503: UNAVAILABLE,
    504: "`/problems/scoring-timeout`: no result within `TOXFLEET_COMPAT_TIMEOUT`; the job goes on",
})


async def _score(texts: list[str], caller: Caller) -> list[dict[str, float]]:
    settings, services = caller.settings, caller.services
    job_id = new_job_id()
    # Watched before it is sent, so that waiting for it needs no first read of its results.
    async with services.read.expecting(job_id, len(contract.chunk(texts))) as finished:
        submitted = await services.submit.submit(texts, owner=caller.key, job_id=job_id)
        view = await finished(settings.compat_timeout, caller.key, submitted.status == "queued")
    if view.status == "failed":
        raise ScoringFailed(view.error or "scoring failed")
    if view.results is None:
        raise ScoringTimeout(f"no result within {settings.compat_timeout}s; job {job_id} is still {view.status}, "
                             f"see /v1/jobs/{job_id}")
    return view.results


@router.get("/toxicity", responses=_ERRORS)
async def toxicity(q: Annotated[str, Query(description="The text to score.")], caller: CallerDep) -> dict[str, float]:
    """Score one text; returns {label: probability}."""
    check_texts([q], caller.settings, loc=("query", "q"))
    return (await _score([q], caller))[0]


@router.post("/toxicity/batch", responses=_ERRORS)
async def toxicity_batch(texts: Annotated[list[str], Body(min_length=1, description="Texts to score.")],
                         caller: CallerDep) -> list[dict[str, float]]:
    """Score a JSON list of texts; returns one {label: probability} per text, in order."""
    check_texts(texts, caller.settings, loc=("body",))
    return await _score(texts, caller)
