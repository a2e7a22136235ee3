"""The Grafana dashboard is valid JSON and charts the metrics the code exports, and only those."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Metric

from testing import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "toxfleet.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _series(families: list[Metric]) -> dict[str, str]:
    """Series name -> family name, for every sample name Prometheus will store."""
    return {f.name + suffix: f.name for f in families if f.name.startswith("toxfleet_")
            for suffix in _SUFFIXES[f.type]}


def _exported() -> dict[str, str]:
    from prometheus_client import REGISTRY

    from api.metrics import UNREAD, FleetCollector  # importing registers the API's own metrics
    from worker.metrics import WorkerMetrics

    worker = CollectorRegistry()
    WorkerMetrics(worker)
    fleet = CollectorRegistry()  # the API's metrics server registers it while serving
    fleet.register(FleetCollector(lambda: UNREAD))
    return _series(list(REGISTRY.collect()) + list(worker.collect()) + list(fleet.collect()))


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_uses_exported_metric_names_and_covers_them_all() -> None:
    """Every toxfleet_* series a panel queries exists in the code, and every metric family has a panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "toxfleet" and dashboard["panels"]
    exported = _exported()
    used = {name for expr in _exprs(dashboard) for name in re.findall(r"\btoxfleet_[a-z_]+", expr)}
    assert used - set(exported) == set(), "dashboard queries series the code does not export"
    assert set(exported.values()) - {exported[n] for n in used} == set(), "metric families without a panel"


def test_flower_series_in_the_dashboard_exist_in_flower() -> None:
    """The Flower series the dashboard borrows are ones Flower's /metrics defines."""
    import flower.events

    source = Path(flower.events.__file__).read_text()
    exprs = _exprs(json.loads(DASHBOARD.read_text()))
    used = {name for expr in exprs for name in re.findall(r"\bflower_[a-z_]+", expr)}
    assert used
    assert all(f"'{name}'" in source for name in used), used


def test_panels_have_unique_ids_and_a_datasource_variable() -> None:
    """Grafana needs unique panel ids; queries go to the dashboard's chosen Prometheus data source."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dashboard["templating"]["list"])
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] for t in p.get("targets", []))
