"""Fuzz the OpenAPI surface with schemathesis against the real API and Redis: never a 500, never a hang;
and through a live fleet with API keys on, every answer as the schema declares it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi import checks

from testing import Fleet, FleetSpec, RedisServer, start_api


@pytest.fixture(scope="module")
def api_url(redis_server: RedisServer, session_tmp: Path) -> Iterator[str]:
    proc, url = start_api(session_tmp, redis_server.flush(), name="fuzz-api", TOXFLEET_MAX_WAIT="0.2",
                          TOXFLEET_COMPAT_TIMEOUT="0.2")
    yield url
    proc.stop()


def test_no_server_errors(api_url: str) -> None:
    """Generated requests (valid and invalid) to every operation get a non-5xx answer within the
    timeout. No worker runs here, so the drop-in endpoints may answer 504 after 0.2 s: their contract."""
    schema = schemathesis.openapi.from_url(api_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 8
    seen: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: Any) -> None:
            response = case.call(base_url=api_url, timeout=10)
            assert response.status_code < 500 or response.status_code == 504, (
                case.method, case.formatted_path, response.status_code, response.text[:300])

        check()
        seen.append(f"{operation.method.upper()} {operation.path}")
    assert "POST /v1/jobs" in seen and "GET /v1/jobs/{job_id}" in seen


LIVE_KEY = "fuzz-live-test-key-0123456789"
FLEET = FleetSpec("fuzzlive", db=11, api_env={"TOXFLEET_API_KEYS": LIVE_KEY, "TOXFLEET_MAX_WAIT": "0.5",
                                              "TOXFLEET_COMPAT_TIMEOUT": "5"})


def test_live_fleet_answers_conform_to_the_schema(fleet: Fleet) -> None:
    """Through uvicorn with a live worker and API keys on: every answer conforms to the OpenAPI
    document (status code declared, content type, response body and headers), no 5xx, and auth is
    enforced (schemathesis retries each authorised success without the key and with a wrong one).
    Not checked: that every schema-valid request is accepted, since the configured limits (texts per
    job, characters, `?wait`, valid Unicode) are narrower than a static schema and answer a documented 422."""
    schema = schemathesis.openapi.from_url(fleet.url + "/openapi.json")

    @schema.auth()
    class Bearer:
        def get(self, case: Any, ctx: Any) -> str:
            return LIVE_KEY

        def set(self, case: Any, data: str, ctx: Any) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}

    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: Any) -> None:
            try:
                case.call_and_validate(base_url=fleet.url, timeout=15,
                                       excluded_checks=[checks.positive_data_acceptance])
            except Exception as exc:  # collected: one operation's failure must not hide the others'
                failures.append(f"{case.operation.method.upper()} {case.operation.path}: {str(exc)[:400]}")

        check()
    assert not failures, "\n".join(sorted(set(failures))[:10])
