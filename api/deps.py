"""Dependencies routes declare with `Annotated` aliases; tests swap them via `dependency_overrides`.

All are `async def` reading `app.state`: FastAPI runs a sync dependency in the threadpool (a thread
hop per dependency per request), and the production app sets no `dependency_overrides`, because
FastAPI re-analyses an overridden dependency's signature on every request (about a third of the
API's CPU per job when settings were overridden that way)."""

from __future__ import annotations

from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from api.services.fleet import FleetService
from api.services.read import ReadService
from api.services.submit import SubmitService
from api.services.wiring import Services
from api.settings import ApiSettings


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_settings(request: Request) -> ApiSettings:
    """The settings `create_app` was given (held in `app.state.settings`)."""
    settings: ApiSettings = request.app.state.settings
    return settings


async def get_submit(request: Request) -> SubmitService:
    return (await get_services(request)).submit


async def get_read(request: Request) -> ReadService:
    return (await get_services(request)).read


async def get_fleet(request: Request) -> FleetService:
    return (await get_services(request)).fleet


async def get_redis(request: Request) -> aioredis.Redis:
    return (await get_services(request)).redis


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
SubmitDep = Annotated[SubmitService, Depends(get_submit)]
ReadDep = Annotated[ReadService, Depends(get_read)]
FleetDep = Annotated[FleetService, Depends(get_fleet)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
