"""The shipped alert rules on a real Prometheus (Debian's binary) scraping a real fleet: Redis, the API
under uvicorn and a Celery worker. Only each alert's `for` is shortened (testing.prometheus), so the
expressions under test are the deployed ones."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet import keys
from fleet import redis_url as urls
from testing import Fleet, FleetSpec, Proc, start_worker, wait_for
from testing.prometheus import alert_state, binary, firing, query, start_prometheus
from tests.integration.test_observability import publish_once, scrape

pytestmark = pytest.mark.skipif(binary() is None, reason="no prometheus binary: Debian's `prometheus` package "
                                "ships it (`apt-get install prometheus`; .ci/run installs it when run as root)")

FLEET = FleetSpec("alerts", db=12, worker_env={"TOXFLEET_CACHE": "false"})

ALERT_FOR = "2s"
"""Every alert's `for` in this test (the shipped rules wait minutes)."""


def _hostport(metrics_url: str) -> str:
    return metrics_url.removeprefix("http://").removesuffix("/metrics")


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet, session_tmp: Path) -> Iterator[str]:
    proc, url = start_prometheus(session_tmp, {"toxfleet-api": [_hostport(fleet.api_metrics)],
                                               "toxfleet-worker": [_hostport(fleet.worker_metrics)]},
                                 alert_for=ALERT_FOR, name="alerts-prometheus")
    try:
        yield url
    finally:
        proc.stop()


def _scraped(url: str, expr: str, value: float) -> bool:
    return [float(r["value"][1]) for r in query(url, expr)] == [value]


def test_fleet_gauges_follow_the_heartbeats(fleet: Fleet, prometheus: str) -> None:
    """The API reports each live worker's running and configured backend and its pool processes, as its
    heartbeat says; the worker exports its failure series at 0 before any failure; and
    ToxfleetFastPathLost fires exactly when that worker, configured `auto`, runs the reference with no
    fidelity decision behind it."""
    hostname = fleet.worker.extra["hostname"]
    raw = urls.sync_client(fleet.redis_url).get(keys.worker_info_key(hostname))
    assert raw is not None
    beat = keys.Heartbeat.decode(raw)
    assert beat.configured == "auto" and beat.backend and beat.concurrency == 2
    api = scrape(fleet.api_metrics)
    labels = {"backend": beat.backend, "configured": "auto", "chosen_by": beat.chosen_by}
    assert api[("toxfleet_fleet_workers", frozenset(labels.items()))] == 1
    assert sum(v for (name, _), v in api.items() if name == "toxfleet_fleet_workers") == 1
    assert api[("toxfleet_worker_processes", frozenset())] == 2
    worker = scrape(fleet.worker_metrics)
    for reason in ("invalid", "scoring", "worker_lost"):
        assert worker[("toxfleet_task_failures_total", frozenset({"reason": reason}.items()))] == 0

    # The CloudWatch side of the same condition: the backlog publisher's FallbackWorkers (FastPathLostAlarm).
    assert publish_once(fleet.redis_url)["FallbackWorkers"] == (beat.chosen_by == "fallback")

    expected = "firing" if beat.chosen_by == "fallback" else "inactive"
    wait_for(lambda: _scraped(prometheus, "max(toxfleet_worker_processes)", 2), 30, "Prometheus scraping the API")
    wait_for(lambda: alert_state(prometheus, "ToxfleetFastPathLost") == expected, 15,
             f"ToxfleetFastPathLost {expected} with backend {beat.backend}, chosen by {beat.chosen_by}")


def test_no_live_workers_fires_when_every_worker_dies_and_resolves_when_one_returns(
        fleet: Fleet, prometheus: str, session_tmp: Path, tiny_checkpoint: tuple[Path, Path]) -> None:
    """inactive while a worker beats; firing once every worker is killed -9 (its heartbeat goes stale);
    inactive again, and gone from /api/v1/alerts, once a new worker beats."""
    wait_for(lambda: _scraped(prometheus, "max(toxfleet_workers)", 1), 30, "Prometheus scraping the API")
    wait_for(lambda: _scraped(prometheus, 'up{job="toxfleet-worker"}', 1), 30, "Prometheus scraping the worker")
    time.sleep(3)  # more than an evaluation and the shortened `for` with a worker alive
    assert alert_state(prometheus, "ToxfleetNoLiveWorkers") == "inactive"
    assert "ToxfleetNoLiveWorkers" not in firing(prometheus)

    assert fleet.worker.proc is not None
    os.killpg(fleet.worker.proc.pid, signal.SIGKILL)  # the worker and its pool: no goodbye, the beat goes stale
    last_beat = urls.sync_client(fleet.redis_url).zscore(keys.WORKERS_KEY, fleet.worker.extra["hostname"])
    assert last_beat is not None
    wait_for(lambda: "ToxfleetNoLiveWorkers" in firing(prometheus), keys.HEARTBEAT_STALE_SECONDS + 45,
             "ToxfleetNoLiveWorkers firing")
    assert alert_state(prometheus, "ToxfleetNoLiveWorkers") == "firing"
    # Not before the last heartbeat went stale: the alert follows the heartbeats.
    assert time.time() >= last_beat + keys.HEARTBEAT_STALE_SECONDS

    replacement: Proc | None = None
    try:
        metrics_port = fleet.worker_metrics.rsplit(":", 1)[1].split("/")[0]
        replacement = start_worker(session_tmp, fleet.redis_url, tiny_checkpoint, name="alerts-back",
                                   env={"TOXFLEET_CACHE": "false", "TOXFLEET_METRICS_PORT": metrics_port})
        wait_for(lambda: alert_state(prometheus, "ToxfleetNoLiveWorkers") == "inactive", 30,
                 "ToxfleetNoLiveWorkers resolved")
        assert "ToxfleetNoLiveWorkers" not in firing(prometheus)
        assert _scraped(prometheus, "max(toxfleet_workers)", 1)
    finally:
        if replacement is not None:
            replacement.stop()

