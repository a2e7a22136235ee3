"""Schemathesis hooks for `test_schemathesis` (loaded by the CLI through `SCHEMATHESIS_HOOKS`).

One behaviour a standard prescribes is exempted from one check, by name: the IETF Idempotency-Key
draft (draft-ietf-httpapi-idempotency-key-header, section 2.7) answers 422 when a key is reused with
a different request body. Schemathesis reuses the header values it generates across requests with
other bodies, and its `positive_data_acceptance` check then reports a schema-valid request rejected.
`positive_data_acceptance_except_idempotency_mismatch` is that check with exactly this response
(422, `type` `/problems/idempotency-mismatch`) let through; the test runs it in the built-in's place.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

IDEMPOTENCY_MISMATCH = "/problems/idempotency-mismatch"


def is_idempotency_mismatch(response: Any) -> bool:
    if response.status_code != 422:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == IDEMPOTENCY_MISMATCH


@schemathesis.check
def positive_data_acceptance_except_idempotency_mismatch(ctx: Any, response: Any, case: Any) -> bool | None:
    """`positive_data_acceptance`, but a reused Idempotency-Key's 422 (the standard's answer) passes."""
    if is_idempotency_mismatch(response):
        return None
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result
