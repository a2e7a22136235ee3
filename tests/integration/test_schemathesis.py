"""The HTTP contract checked by a client nobody here wrote: the `schemathesis` CLI, every check it has
and every phase (examples, coverage, fuzzing, stateful), against the real uvicorn server of a live
fleet with API keys on, as two identities (so that its object-level authorization check can replay
one key's reads with the other's).

One exemption, by name: a reused Idempotency-Key with another body answers 422, as the IETF
Idempotency-Key draft prescribes; `schemathesis_hooks` runs `positive_data_acceptance` with exactly
that response let through, in the built-in check's place. Everything else schemathesis reports fails
this test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testing import ROOT, Fleet, FleetSpec

KEYS = {"alice": "schemathesis-alice-0123456789", "bob": "schemathesis-bob-0123456789"}
LIMITS = {"TOXFLEET_MAX_TEXTS": "20", "TOXFLEET_MAX_TEXT_CHARS": "200", "TOXFLEET_MAX_WAIT": "2",
          "TOXFLEET_COMPAT_TIMEOUT": "10"}
"""Small limits, so that generated jobs stay cheap for the tiny worker; the OpenAPI document states them."""

FLEET = FleetSpec("contract", db=12, api_env={"TOXFLEET_API_KEYS": ",".join(KEYS.values()),
                                              "TOXFLEET_BACKLOG_PER_PROCESS": "10000", **LIMITS})

SEED = 20261207
MAX_EXAMPLES = 100
"""Per operation and phase: 9 operations, some 1,300 requests, 20-60 s on 2 shared cores."""

HOOKS = "tests.integration.schemathesis_hooks"
EXEMPTED = "positive_data_acceptance"
"""The built-in check run through `schemathesis_hooks.positive_data_acceptance_except_idempotency_mismatch`."""


@pytest.mark.slow
def test_schemathesis_finds_nothing_with_every_check_and_phase(fleet: Fleet, tmp_path: Path) -> None:
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auth": [
        {"name": name, "fixedHeaders": [{"name": "Authorization", "value": f"Bearer {key}"}]}
        for name, key in KEYS.items()]}))
    report = tmp_path / "events.ndjson"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{fleet.url}/openapi.json",
            "--checks", "all", "--exclude-checks", EXEMPTED,
            "--phases", "examples,coverage,fuzzing,stateful",
            "--auth-wfc", str(auth), "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
            "--workers", "1", "--request-timeout", "20", "--max-failures", "20",
            "--report", "ndjson", "--report-ndjson-path", str(report), "--output-truncate", "false"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    output = done.stdout + done.stderr
    print(output[-2500:])  # the run's summary, shown with -s or on failure
    assert done.returncode == 0, output[-12000:]
    # It really ran: every operation, every phase, and the exempting check in place of the built-in.
    assert "9 selected / 9 total" in output and "No issues found" in output, output[-3000:]
    checks = set(re.findall(r'"name":\s*"([a-z_]+)"', report.read_text()))
    assert {"stateful", "fuzzing", "coverage", "object_level_authorization", "ignored_auth", "use_after_free",
            "ensure_resource_availability", "negative_data_rejection", "response_schema_conformance",
            "positive_data_acceptance_except_idempotency_mismatch"} <= checks, sorted(checks)
    assert EXEMPTED not in checks, sorted(checks)
