"""The ASGI app: `uvicorn api.main:app`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig

from api import admission, auth, bodylimit, errors, metrics_server, openapi
from api.deps import keyed_operations
from api.metrics import LOOP_LAG, MetricsMiddleware
from api.routes import compat, health, jobs
from api.services.wiring import make_services
from api.settings import ApiSettings, get_settings
from fleet import logs

NEW_WORK = (jobs.submit_job, compat.toxicity, compat.toxicity_batch)
"""Endpoints that bring new work: the ones `api.admission` refuses while this process lags."""

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
"""Loggers uvicorn configures itself (before it imports the app); JSON mode reformats their handlers."""


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure(settings.log_format, json_loggers=UVICORN_LOGGERS)
    logs.redact_access_log()

    lag = admission.LoopLag()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = make_services(settings)
        metrics = None
        try:
            lag.start()
            if settings.api_metrics_port:
                LOOP_LAG.set_function(lag.seconds)
                metrics = metrics_server.start(settings, app.state.services.fleet, asyncio.get_running_loop())
            yield
        finally:
            if metrics is not None:
                # Off the loop: a scrape in flight may be waiting for the loop to read Redis.
                await asyncio.to_thread(metrics.stop)
            await lag.stop()
            await app.state.services.close()

    # toxfleet exports Prometheus metrics and JSON logs; FastAPI's own OpenTelemetry is opt-in (TOXFLEET_OTEL).
    telemetry: TelemetryConfig | None = None if settings.otel else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="toxfleet", version="0.1.0", lifespan=lifespan, telemetry=telemetry,
                  description="Toxicity scoring with Detoxify on a batched Celery worker fleet. "
                              "Submit with `POST /v1/jobs`, then `GET` the `Location` it returns.")
    app.state.settings = settings  # read by api.deps.get_caller
    errors.install(app)
    bodylimit.install(app, settings.max_body_bytes)
    # No /metrics route: metrics have a listener of their own (api.metrics_server), never this one.
    routers = [jobs.router, compat.router, health.router]
    for router in routers:
        app.include_router(router)
    routes = [r for router in routers for r in router.routes]  # included without a prefix of their own
    errors.index_methods(app, [*app.router.routes, *routes])
    auth.document_bearer(app, keyed_operations(routes))
    openapi.document_limits(app, settings)
    # Inside the metrics middleware, so that its 429s are counted; outside the body limit, the cheaper refusal.
    admission.install(app, lag, settings.max_loop_lag, admission.guarded_paths(routes, NEW_WORK))
    if settings.api_metrics_port:
        # Added last, so outermost: it also counts requests refused before routing (413).
        app.add_middleware(MetricsMiddleware, routes=routes)
    return app


app = create_app()
