"""Dependencies routes declare with `Annotated` aliases; tests swap them via `dependency_overrides`.

All are `async def` reading `app.state`: FastAPI runs a sync dependency in the threadpool (a thread
hop per dependency per request), and the production app sets no `dependency_overrides`, because
FastAPI re-analyses an overridden dependency's signature on every request, which would dominate
the API's CPU per job.

A job or scoring route takes one `CallerDep` (settings, services and the caller's key at once)
rather than one dependency each: FastAPI solves every dependency, and every dependency's own, on
every request, so each dependency a route declares costs every job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from api.auth import check_key
from api.services.fleet import FleetService
from api.services.wiring import Services
from api.settings import ApiSettings


@dataclass(frozen=True)
class Caller:
    """What a job or scoring route needs: the settings `create_app` was given (`app.state.settings`),
    the process's services, and the caller's key id (None while API keys are off)."""

    settings: ApiSettings
    services: Services
    key: str | None


async def get_caller(request: Request) -> Caller:
    """401 without a valid key (when keys are configured), 429 over the key's rate limit."""
    settings: ApiSettings = request.app.state.settings
    services: Services = request.app.state.services
    return Caller(settings, services, await check_key(request, settings, services.redis))


async def get_fleet(request: Request) -> FleetService:
    services: Services = request.app.state.services
    return services.fleet


def keyed_operations(routes: list[BaseRoute]) -> set[tuple[str, str]]:
    """The (path, method) of every route that takes `CallerDep`: the ones API keys guard."""
    return {(route.path, method.lower()) for route in routes if isinstance(route, APIRoute)
            if any(dep.call is get_caller for dep in route.dependant.dependencies) for method in route.methods or ()}


CallerDep = Annotated[Caller, Depends(get_caller)]
FleetDep = Annotated[FleetService, Depends(get_fleet)]
