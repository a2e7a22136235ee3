"""Liveness, readiness, and the existing service's health endpoints."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api.deps import FleetDep
from api.schemas import GateFigures, Health, Readiness, RuntimeGate, WorkerBackend

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive (no dependencies checked)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(fleet: FleetDep) -> Readiness | JSONResponse:
    """Ready when the broker answers; also says how many workers answer and what they run."""
    try:
        await fleet.ping()
        workers = await fleet.workers()
        depth = await fleet.queue_depth()
    except RedisError:
        body = Readiness(status="unavailable", broker="unreachable", workers=0, models=[], queue_depth=None)
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "2"})
    models = sorted({w.model or "?" for w in workers})
    backends = [WorkerBackend(hostname=w.hostname, model=w.model, backend=w.backend,
                              gate=GateFigures.model_validate(w.gate) if w.gate else None, why=w.why,
                              gating=RuntimeGate.model_validate(w.gating) if w.gating else None)
                for w in workers]
    return Readiness(status="ready", broker="ok", workers=len(workers), models=models, queue_depth=depth,
                     backends=backends)


@router.get("/healthcheck", response_model=Health)
async def healthcheck() -> Health:
    """Drop-in for the existing service's health endpoint."""
    return Health(status="OK")


@router.get("/healthcheck/loadbalancer", response_model=Health)
async def healthcheck_loadbalancer() -> Health:
    """Drop-in for the existing service's load-balancer health endpoint."""
    return Health(status="OK")
