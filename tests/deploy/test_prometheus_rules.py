"""The Prometheus alert rules (deploy/prometheus/): promtool finds them and the scrape config valid and
runs their unit tests, they query only series the code exports, and every alert has a runbook entry
and tests that show it firing on its fault and silent on a healthy idle fleet."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testing import ROOT
from testing.prometheus import RULES, with_short_for
from tests.deploy.test_dashboard import _exported

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_TESTS = sorted(PROMETHEUS_DIR.glob("*_test.yml"))
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RUNBOOK = ROOT / "docs" / "observability.md"


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run Debian's promtool (the `prometheus` package; `.ci/run` installs it), or skip saying why."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed: Debian's `prometheus` package ships it "
                    "(`apt-get install prometheus`; .ci/run installs it when run as root)")
    return subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    checked = promtool("check", "rules", RULES)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    assert "lint" not in checked.stderr.lower(), checked.stderr
    config = promtool("check", "config", SCRAPE_CONFIG)
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert RULE_TESTS
    run = promtool("test", "rules", *RULE_TESTS)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_rules_query_only_series_the_code_exports() -> None:
    """A rule on a misspelt or removed series never fires; every toxfleet_* name must exist."""
    exported = _exported()
    used = {name for rule in rules() for name in re.findall(r"\btoxfleet_[a-z_]+", rule["expr"])}
    assert used and used - set(exported) == set(), "rules query series the code does not export"


def test_scrape_jobs_and_ports_match_the_rules_and_the_defaults() -> None:
    """The rules' `job` labels are the scrape config's job names, and its targets are `make run`'s
    ports: the settings' defaults and scripts/run.sh's Flower port."""
    from api.settings import ApiSettings
    from worker.settings import WorkerSettings

    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert config["rule_files"] == [RULES.name]
    targets = {job["job_name"]: [t for s in job["static_configs"] for t in s["targets"]]
               for job in config["scrape_configs"]}
    used = {job for rule in rules() for job in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert used and used <= set(targets)
    # The fields' defaults, not this environment's values (the tests set TOXFLEET_API_METRICS_PORT=0).
    assert targets["toxfleet-api"] == [f"127.0.0.1:{ApiSettings.model_fields['api_metrics_port'].default}"]
    assert targets["toxfleet-worker"] == [f"127.0.0.1:{WorkerSettings.model_fields['metrics_port'].default}"]
    flower_port = re.search(r"FLOWER_PORT=\$\{FLOWER_PORT:-(\d+)\}", (ROOT / "scripts" / "run.sh").read_text())
    assert flower_port and targets["toxfleet-flower"] == [f"127.0.0.1:{flower_port.group(1)}"]


def _tested(alertname: str) -> tuple[list[Any], list[Any]]:
    """(cases expecting `alertname` to fire, cases expecting it silent) over every rule test file."""
    firing: list[Any] = []
    silent: list[Any] = []
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                if case["alertname"] == alertname:
                    (firing if case["exp_alerts"] else silent).append((test["name"], case["eval_time"]))
    return firing, silent


def test_every_alert_has_a_runbook_entry_and_tests_both_ways() -> None:
    runbook = RUNBOOK.read_text()
    headings = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
                for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    idle_tests = [t for path in RULE_TESTS for t in yaml.safe_load(path.read_text())["tests"]
                  if t["name"].startswith("idle fleet")]
    assert len(idle_tests) >= 2
    for name, rule in alerts().items():
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/observability.md#{name.lower()}", url
        assert name.lower() in headings, f"no runbook entry for {name} in {RUNBOOK.name}"
        assert rule["labels"]["severity"] in {"page", "warning", "ticket"}
        firing, silent = _tested(name)
        assert firing, f"no test shows {name} firing"
        assert silent, f"no test shows {name} silent"
        for idle in idle_tests:
            assert any(c["alertname"] == name and c["exp_alerts"] == [] for c in idle["alert_rule_test"]), \
                f"{idle['name']!r} does not check {name}"


def test_thresholds_state_their_reasons() -> None:
    """Each alert's comment in the rules file says where its threshold comes from: a measured figure
    (docs/benchmarks.md, docs/reliability.md), the SRE workbook's burn rates, or a stated judgment."""
    text = RULES.read_text()
    for name in alerts():
        block = text.split(f"- alert: {name}\n", 1)[1].split("- alert:", 1)[0]
        comment = " ".join(line.strip().lstrip("# ") for line in block.splitlines() if line.strip().startswith("#"))
        assert re.search(r"judgment|docs/benchmarks\.md|docs/reliability\.md|SRE workbook", comment, re.I), \
            f"{name}: the comment does not say where its threshold comes from: {comment!r}"


def test_short_for_keeps_every_expression() -> None:
    """The integration test's rules differ from the shipped ones in `for` only."""
    short = yaml.safe_load(with_short_for(RULES.read_text(), "1s"))
    shipped = yaml.safe_load(RULES.read_text())
    for group, short_group in zip(shipped["groups"], short["groups"], strict=True):
        for rule, short_rule in zip(group["rules"], short_group["rules"], strict=True):
            assert {k: v for k, v in short_rule.items() if k != "for"} == {k: v for k, v in rule.items() if k != "for"}
            assert short_rule.get("for") == ("1s" if "for" in rule else None)
