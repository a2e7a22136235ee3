"""A real Prometheus server (Debian's `prometheus` binary) for the tests: the shipped alert rules,
scraping and evaluating every second, with each alert's `for` shortened so that a test waits seconds.

Only `for` changes: the expressions are the shipped ones, so a test exercises the rules as deployed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import yaml

from testing.processes import ROOT, GaveUp, Proc, free_port, wait_for

RULES = ROOT / "deploy" / "prometheus" / "toxfleet-rules.yml"


def with_short_for(text: str, duration: str) -> str:
    """A rules file with every alert's `for` replaced by `duration` (the rest unchanged)."""
    doc = yaml.safe_load(text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule and "for" in rule:
                rule["for"] = duration
    return str(yaml.safe_dump(doc, sort_keys=False))


def binary() -> str | None:
    return shutil.which("prometheus")


def start_prometheus(tmp: Path, targets: dict[str, list[str]], alert_for: str = "2s",
                     scrape: str = "2s", evaluate: str = "1s", name: str = "prometheus") -> tuple[Proc, str]:
    """Prometheus on a free 127.0.0.1 port scraping `targets` (job name -> host:port list) every
    `scrape` and evaluating the shipped rules every `evaluate`; returns the process and its base URL.
    A scrape may take its whole interval: on a loaded machine a shorter timeout would drop samples
    and reset a pending alert."""
    path = binary()
    assert path is not None, "no prometheus binary (Debian's `prometheus` package)"
    workdir = tmp / name
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / RULES.name).write_text(with_short_for(RULES.read_text(), alert_for))
    config = {
        "global": {"scrape_interval": scrape, "scrape_timeout": scrape, "evaluation_interval": evaluate},
        "rule_files": [RULES.name],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                           for job, hosts in targets.items()],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    proc = Proc(name, [path, f"--config.file={workdir / 'prometheus.yml'}",
                       f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                       "--web.enable-lifecycle"],
                {"PATH": "/usr/bin:/bin"}, workdir / "prometheus.log").start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not proc.alive():
            raise GaveUp(f"prometheus exited:\n{proc.output()[-3000:]}")
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200

    try:
        wait_for(ready, 30, "prometheus", interval=0.2)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def api(url: str, path: str, **params: str) -> Any:
    response = httpx.get(url + path, params=params, timeout=5)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def alert_state(url: str, alertname: str) -> str:
    """`inactive`, `pending` or `firing`: the state Prometheus's rule manager holds for the alert."""
    for group in api(url, "/api/v1/rules", type="alert")["groups"]:
        for rule in group["rules"]:
            if rule["name"] == alertname:
                return str(rule["state"])
    raise KeyError(alertname)


def firing(url: str) -> set[str]:
    """Names of the alerts firing now (/api/v1/alerts)."""
    return {a["labels"]["alertname"] for a in api(url, "/api/v1/alerts")["alerts"] if a["state"] == "firing"}


def query(url: str, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = api(url, "/api/v1/query", query=expr)["result"]
    return result
