"""Dependencies routes declare with `Annotated` aliases; tests swap them via `dependency_overrides`."""

from __future__ import annotations

from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from api.services.fleet import FleetService
from api.services.read import ReadService
from api.services.submit import SubmitService
from api.services.wiring import Services
from api.settings import ApiSettings, get_settings


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def get_submit(request: Request) -> SubmitService:
    return get_services(request).submit


def get_read(request: Request) -> ReadService:
    return get_services(request).read


def get_fleet(request: Request) -> FleetService:
    return get_services(request).fleet


def get_redis(request: Request) -> aioredis.Redis:
    return get_services(request).redis


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
SubmitDep = Annotated[SubmitService, Depends(get_submit)]
ReadDep = Annotated[ReadService, Depends(get_read)]
FleetDep = Annotated[FleetService, Depends(get_fleet)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
