"""The OpenAPI document states the limits this process enforces.

The limits are settings (`max_texts`, `max_text_chars`, `max_wait`), read at start, so they cannot be
written into the pydantic models; without them in the document a client generated from it (or a
contract tester) sends a request the schema allows and gets a 422. They are added to the document
FastAPI builds, once, where each limited value is declared.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from api.settings import ApiSettings


def _texts(schema: dict[str, Any], settings: ApiSettings) -> None:
    """A JSON list of texts: at most `max_texts`, each at most `max_text_chars` characters."""
    schema["maxItems"] = settings.max_texts
    schema.setdefault("items", {"type": "string"})["maxLength"] = settings.max_text_chars


def _parameter(operation: dict[str, Any], name: str) -> dict[str, Any]:
    (parameter,) = [p for p in operation.get("parameters", ()) if p["name"] == name]
    schema: dict[str, Any] = parameter["schema"]
    return schema


def document_limits(app: FastAPI, settings: ApiSettings) -> None:
    """Write the configured limits into the app's OpenAPI document (built once, on first request)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()  # FastAPI keeps it as app.openapi_schema, so this runs once
        paths = spec["paths"]
        _texts(spec["components"]["schemas"]["JobRequest"]["properties"]["texts"], settings)
        _parameter(paths["/v1/jobs/{job_id}"]["get"], "wait")["maximum"] = settings.max_wait
        _parameter(paths["/toxicity"]["get"], "q")["maxLength"] = settings.max_text_chars
        batch = paths["/toxicity/batch"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        _texts(batch, settings)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
