"""Dependencies routes declare with `Annotated` aliases; tests swap them via `dependency_overrides`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.jobs import JobService
from api.settings import ApiSettings, get_settings


def get_jobs(request: Request) -> JobService:
    service: JobService = request.app.state.jobs
    return service


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
JobsDep = Annotated[JobService, Depends(get_jobs)]
