"""Redis Sentinel failover under load: a primary, its replica and three sentinels (quorum 2) on loopback;
a real worker, the API under uvicorn and Flower, all given only the Sentinel URL. The primary is killed -9
in the middle of a bulk `Client.score()`; the sentinels promote the replica; every text still comes back
once, in order, with Detoxify's scores, and the API, the worker and Flower are the same processes
throughout: they find the new primary by themselves.

Measured and printed: jobs lost through the client (and how many it resubmitted), the API's 503
window (from the kill until a submit is accepted again), the sentinels' failover time and the
recovery time (from the kill until a job submitted after it is scored).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet import keys
from fleet.corpus import CommentCorpus
from testing import Proc, start_api, start_flower, start_worker, wait_for
from testing.faults import ExecutionLog, ResultObserver, client_summary, observing
from testing.scoring import BackgroundScore, assert_detoxify_scores
from testing.sentinel import SentinelGroup
from testing.services import execution_log
from toxfleet.client import Client

pytestmark = pytest.mark.faults

WORKER_ENV = {"TOXFLEET_VISIBILITY_TIMEOUT": "10", "TOXFLEET_SWEEP_SECONDS": "2"}
"""Messages a worker held when its broker connection died come back after 10 s (120 s by default)."""


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    sentinels = SentinelGroup(tmp_path / "sentinel", down_after_ms=1000, failover_timeout_ms=3000)
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop()


@pytest.fixture
def observer(group: SentinelGroup) -> Iterator[ResultObserver]:
    """Counts the final results published through the group, subscribed before any load starts."""
    with observing(group.url) as results:
        yield results


def finished_jobs(group: SentinelGroup, port: int) -> int:
    return sum(1 for _ in group.node(port).scan_iter("celery-task-meta-*", count=500))


class Probe(threading.Thread):
    """Submits a one-text job every 50 ms over raw HTTP (no retries) until one is accepted; then waits
    for it to be scored. Times are seconds after `t0`."""

    def __init__(self, url: str, t0: float) -> None:
        super().__init__(daemon=True)
        self.url, self.t0 = url, t0
        self.statuses: list[int] = []
        self.accepted_s: float | None = None
        self.scored_s: float | None = None

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as http:
            job = None
            while job is None and time.monotonic() - self.t0 < 60:
                try:
                    r = http.post("/v1/jobs", json={"texts": [f"probe {time.monotonic()}"]})
                    self.statuses.append(r.status_code)
                    if r.status_code == 202:
                        job, self.accepted_s = r.json()["id"], time.monotonic() - self.t0
                except httpx.HTTPError:
                    self.statuses.append(0)
                time.sleep(0.05)
            while job is not None and time.monotonic() - self.t0 < 90:
                try:  # a long-poll of 2 s under a 5 s read timeout: never cut off by the timeout
                    r = http.get(f"/v1/jobs/{job}", params={"wait": 2})
                except httpx.HTTPError:
                    continue
                if r.status_code == 200 and r.json()["status"] == "succeeded":
                    self.scored_s = time.monotonic() - self.t0
                    return


def test_sentinel_failover_mid_load(group: SentinelGroup, observer: ResultObserver, tiny_checkpoint: tuple[Path, Path],
                                    tiny_detoxify: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    attempt: int) -> None:
    caplog.set_level(logging.WARNING, logger="toxfleet.client")
    url = group.url
    worker = start_worker(tmp_path, url, tiny_checkpoint, name="sentinel-w", concurrency=1, env=WORKER_ENV)
    procs: list[Proc] = [worker]
    try:
        api, api_url = start_api(tmp_path, url, name="sentinel-api")
        procs.append(api)
        flower, flower_url = start_flower(tmp_path, worker.env, ("admin", "sentinel-test"), name="sentinel-flower")
        procs.append(flower)
        pids = [p.proc.pid for p in procs if p.proc is not None]
        texts = CommentCorpus(31).texts(400)
        load = BackgroundScore(api_url, texts, stall_after=30, job_size=10, in_flight=4)
        load.start()
        primary = group.master_port()
        wait_for(lambda: finished_jobs(group, primary) >= 4, 60, "the first jobs to finish", interval=0.02)
        assert load.is_alive(), "the load finished before the fault: nothing was shown"

        group.kill(primary)
        t0 = time.monotonic()
        probe = Probe(api_url, t0)
        probe.start()
        failover_s = group.wait_for_failover(primary)
        assert group.master_port() == group.ports[1]
        probe.join(120)
        results = load.outcome(240)
        done_s = time.monotonic() - t0
        resubmitted = sum("submitted again" in r.getMessage() for r in caplog.records)
        refused = sum(s != 202 for s in probe.statuses)
        seen = f"accepted={probe.accepted_s} scored={probe.scored_s} statuses={Counter(probe.statuses)}"
        assert probe.accepted_s is not None and probe.scored_s is not None, seen
        assert refused > 0, "no submit was refused: the fault was not seen by the API"
        assert set(probe.statuses) <= {202, 503}, probe.statuses  # never a 500 or a hang
        s = client_summary("redis-failover", load, observer, ExecutionLog(execution_log(tmp_path)), t0, api_url,
                           refused_submits=refused, probe_scored_s=round(probe.scored_s, 2),
                           sentinels_promoted_s=round(failover_s, 2))
        print(f"FAILOVER sentinels_promoted_s={failover_s:.2f} api_503_window_s={probe.accepted_s:.2f} "
              f"recovery_s={probe.scored_s:.2f} load_done_s={done_s:.1f} resubmitted={resubmitted}")
        # An up-to-date replica: nothing lost, nothing read differently. A batch whose store met the dead
        # primary is scored again (at least once): counted in `rescored`, not refused.
        assert s["lost"] == 0 and s["changed"] == 0, s
        assert_detoxify_scores(tiny_detoxify, texts, results)  # in order, and Detoxify's own scores

        # Nobody was restarted: the same processes serve a fresh job, the worker beats to the new
        # primary (readyz counts it), and Flower still reaches the broker.
        assert all(p.alive() for p in procs) and [p.proc.pid for p in procs if p.proc is not None] == pids
        with Client(api_url) as c:
            assert len(c.score(texts[:5])) == 5
        assert httpx.get(api_url + "/readyz", timeout=5).json()["workers"] >= 1
        auth = ("admin", "sentinel-test")

        def flower_sees_worker() -> bool:
            r = httpx.get(flower_url + "/api/workers", params={"refresh": "1"}, auth=auth, timeout=10)
            return r.status_code == 200 and worker.extra["hostname"] in r.json()

        wait_for(flower_sees_worker, 30, "Flower to see the worker through the new primary", interval=0.5)
    finally:
        for p in reversed(procs):
            p.stop()


def job_ids(group: SentinelGroup, port: int) -> set[str]:
    prefix = keys.JOB_KEY_PREFIX.encode()
    return {k[len(prefix):].decode() for k in group.node(port).scan_iter(prefix + b"*", count=500)}


def test_failover_to_a_lagging_replica(group: SentinelGroup, observer: ResultObserver,
                                       tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture, attempt: int) -> None:
    """Replication is asynchronous: the replica promoted may miss the last writes the primary
    acknowledged. Here it misses several seconds of them (cut off, then the primary killed -9): jobs
    that answered 202, their messages, results and acks. The official client still returns every text
    once, in order, with Detoxify's scores: a job the new primary never saw answers 404 and is
    submitted again under its Idempotency-Key; messages it holds as unacked come back after the
    visibility timeout. Scoring a task twice is allowed here (at least once): counted, not refused."""
    caplog.set_level(logging.WARNING, logger="toxfleet.client")
    url = group.url
    worker = start_worker(tmp_path, url, tiny_checkpoint, name="lag-w", concurrency=1, env=WORKER_ENV)
    procs: list[Proc] = [worker]
    try:
        api, api_url = start_api(tmp_path, url, name="lag-api")
        procs.append(api)
        texts = CommentCorpus(37).texts(400)
        load = BackgroundScore(api_url, texts, stall_after=30, job_size=10, in_flight=4)
        load.start()
        primary, replica = group.ports
        wait_for(lambda: finished_jobs(group, primary) >= 4, 60, "the first jobs to finish", interval=0.02)
        before = job_ids(group, primary)
        cut_offset = group.cut_off_replica(primary, replica)
        # Jobs accepted after the cut exist on the primary only; with 4 in flight, the client is
        # still waiting on some of them when the primary dies.
        wait_for(lambda: len(job_ids(group, primary) - before) >= 8, 60, "jobs accepted after the cut", interval=0.05)
        assert load.is_alive(), "the load finished before the fault: nothing was shown"
        accepted = job_ids(group, primary)
        lag_bytes = group.offset(primary) - cut_offset
        group.kill(primary)
        t0 = time.monotonic()
        group.resume(replica)
        failover_s = group.wait_for_failover(primary)
        assert group.master_port() == replica
        unknown = accepted - job_ids(group, replica)
        assert unknown, "the new primary holds every job: the replica did not lag"
        results = load.outcome(240)
        done_s = time.monotonic() - t0
        resubmitted = sum("submitted again" in r.getMessage() for r in caplog.records)
        # Scoring twice is allowed in this case only (at least once): counted, from the worker's record.
        s = client_summary("redis-failover-lagging", load, observer, ExecutionLog(execution_log(tmp_path)), t0,
                           api_url, jobs_the_replica_missed=len(unknown))
        print(f"LAGGING FAILOVER replica_missed_jobs={len(unknown)} of {len(accepted)} "
              f"replica_missed_bytes={lag_bytes} sentinels_promoted_s={failover_s:.2f} resubmitted={resubmitted} "
              f"tasks_scored_twice={s['rescored']} load_done_s={done_s:.1f}")
        assert s["lost"] == 0 and s["changed"] == 0, s
        assert resubmitted >= 1, "no job was submitted again: the client never met a job the broker lost"
        assert_detoxify_scores(tiny_detoxify, texts, results)  # every text once, in order, Detoxify's scores
        assert all(p.alive() for p in procs)
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A primary and one replica, no sentinels: what `WAIT` needs."""
    pair = SentinelGroup(tmp_path / "pair", sentinels=0)
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()


NO_BACKLOG_LIMIT = {"TOXFLEET_BACKLOG_PER_PROCESS": "100000", "TOXFLEET_MAX_QUEUE_DEPTH": "1000000"}
"""No worker runs in the WAIT tests: without this, the 65th waiting message would be a 429."""


def submit_latencies(http: httpx.Client, n: int, tag: str) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        r = http.post("/v1/jobs", json={"texts": [f"{tag} {i}"]})
        times.append(time.perf_counter() - t)
        assert r.status_code == 202, r.text
    return times


def test_wait_for_a_replica_before_the_202(replicated: SentinelGroup, tmp_path: Path) -> None:
    """With `TOXFLEET_SUBMIT_MIN_REPLICAS=1` a 202 means a replica holds the job; without a replica the
    submit is a 503 `not-replicated` (never a 202, never a hang). The cost of the wait is measured
    against an API without it, on the same primary, in alternating rounds."""
    primary, replica = replicated.ports
    url = f"redis://127.0.0.1:{primary}/0"
    waiting, waiting_url = start_api(tmp_path, url, "wait-api", False, TOXFLEET_SUBMIT_MIN_REPLICAS="1",
                                     TOXFLEET_SUBMIT_REPLICA_TIMEOUT="0.3", **NO_BACKLOG_LIMIT)
    plain, plain_url = start_api(tmp_path, url, "plain-api", False, **NO_BACKLOG_LIMIT)
    try:
        with httpx.Client(base_url=waiting_url, timeout=5) as w, httpx.Client(base_url=plain_url, timeout=5) as p:
            submit_latencies(w, 20, "warm-w")
            submit_latencies(p, 20, "warm-p")
            with_wait: list[float] = []
            without: list[float] = []
            for rnd in range(5):  # alternating rounds: a noisy neighbour hits both alike
                with_wait += submit_latencies(w, 60, f"w{rnd}")
                without += submit_latencies(p, 60, f"p{rnd}")
            job = w.post("/v1/jobs", json={"texts": ["held by the replica"]}).json()["id"]
            assert replicated.node(replica).exists(keys.job_key(job))  # on the replica before the 202

            replicated.kill(replica)
            t = time.monotonic()
            r = w.post("/v1/jobs", json={"texts": ["no replica"]}, headers={"Idempotency-Key": "no-replica-1"})
            refused_s = time.monotonic() - t
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["type"] == "/problems/not-replicated" and "retry-after" in r.headers
            assert refused_s < 2
            # The same key again: the job exists on the primary, but still no replica holds it.
            again = w.post("/v1/jobs", json={"texts": ["no replica"]}, headers={"Idempotency-Key": "no-replica-1"})
            assert again.status_code == 503
            assert p.post("/v1/jobs", json={"texts": ["no wait"]}).status_code == 202  # the setting's off there

        def q(xs: list[float], f: float) -> float:
            return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] * 1000

        print(f"\nWAIT submit latency ms (n={len(with_wait)} each, load {os.getloadavg()[0]:.1f}): "
              f"with WAIT 1 p50={q(with_wait, .5):.2f} "
              f"p99={q(with_wait, .99):.2f}; without p50={q(without, .5):.2f} p99={q(without, .99):.2f}; "
              f"no replica: 503 in {refused_s * 1000:.0f} ms")
    finally:
        plain.stop()
        waiting.stop()
