"""What the fault suite and the soak share: an observer of final results, a load of jobs over HTTP,
the per-case statistics of repeated fault runs, and where a worker's batches run.

A case's run is `record`ed (lost, duplicated, recovery time); `report` prints one line per case with
the median and the maximum recovery time over its runs and writes them to `var/faults.json`.
"""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from fleet import redis_url as urls
from fleet.corpus import CommentCorpus
from testing.processes import ROOT, wait_for
from toxfleet import contract
from toxfleet.client.protocol import Submission


class ResultObserver(threading.Thread):
    """Counts every final result Celery's backend publishes, per task id (survives Redis restarts)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.finals: Counter[str] = Counter()
        self.stopped = threading.Event()
        self.subscribed = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                pubsub = urls.sync_client(self.url, socket_timeout=1).pubsub()  # type: ignore[no-untyped-call]
                pubsub.psubscribe("celery-task-meta-*")
                self.subscribed.set()
                while not self.stopped.is_set():
                    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if message and message["type"] == "pmessage":
                        meta = json.loads(message["data"])
                        if meta["status"] in ("SUCCESS", "FAILURE"):
                            self.finals[meta["task_id"]] += 1
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.2)


@dataclass
class Load:
    """A set of jobs submitted over HTTP, each under its own Idempotency-Key, and what became of them."""

    api: str
    texts: dict[str, list[str]] = field(default_factory=dict)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    submissions: dict[str, Submission] = field(default_factory=dict)
    resubmitted: int = 0
    """Jobs that answered 404 (gone with the broker) and were submitted again, as the official client does."""

    def _post(self, submission: Submission) -> str:
        for _ in range(50):
            r = httpx.post(self.api + "/v1/jobs", json=submission.body, headers=submission.headers(), timeout=10)
            if r.status_code == 202:
                return str(r.json()["id"])
            time.sleep(0.2)  # 503 while Redis restarts: the client retries, as documented
        raise AssertionError(f"could not submit: {r.status_code} {r.text}")

    def submit(self, jobs: list[list[str]], threads: int = 8) -> None:
        """Submit every job (`threads` at a time: with 1, in order)."""
        def post(texts: list[str]) -> tuple[str, Submission]:
            submission = Submission({"texts": texts}, uuid.uuid4().hex)
            return self._post(submission), submission

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for job_id, submission in pool.map(post, jobs):
                self.texts[job_id] = submission.body["texts"]
                self.submissions[job_id] = submission

    def settle(self, deadline_s: float, resubmit: bool = False) -> None:
        """Poll every job until it is final or the deadline passes. A job that answers 404 is lost,
        unless `resubmit`: then it is submitted again under its Idempotency-Key and polled in turn."""
        deadline = time.monotonic() + deadline_s
        pending = set(self.texts)
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                try:
                    r = httpx.get(f"{self.api}/v1/jobs/{job_id}", params={"wait": 1}, timeout=10)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if r.status_code == 200 and r.json()["status"] in ("succeeded", "failed"):
                    self.bodies[job_id] = r.json()
                    pending.discard(job_id)
                elif r.status_code == 404 and resubmit:
                    pending.discard(job_id)
                    pending.add(self._again(job_id))
                elif r.status_code == 404:
                    self.bodies[job_id] = {"status": "lost"}
                    pending.discard(job_id)

    def _again(self, lost_id: str) -> str:
        submission = self.submissions.pop(lost_id)
        while not submission.answered(lost_id, new_id := self._post(submission), "answered 404"):
            pass
        self.texts[new_id] = self.texts.pop(lost_id)
        self.submissions[new_id] = submission
        self.resubmitted += 1
        return new_id


def summarize(name: str, load: Load, observer: ResultObserver, recovery_s: float) -> dict[str, int]:
    chunk_ids = {contract.chunk_task_id(j, i) for j in load.texts for i in range(len(contract.chunk(load.texts[j])))}
    statuses = Counter(load.bodies.get(j, {}).get("status", "lost") for j in load.texts)
    failed_without_reason = sum(1 for b in load.bodies.values() if b["status"] == "failed" and not b.get("error"))
    summary = {"submitted": len(load.texts), "succeeded": statuses["succeeded"], "failed": statuses["failed"],
               "lost": len(load.texts) - statuses["succeeded"] - statuses["failed"] + failed_without_reason,
               "duplicated": sum(1 for t in chunk_ids if observer.finals[t] > 1), "resubmitted": load.resubmitted}
    record(name, summary, recovery_s)
    return summary


RUNS: dict[str, list[dict[str, float]]] = defaultdict(list)
"""Every recorded run of this process, per case."""


def record(name: str, summary: Mapping[str, float], recovery_s: float) -> None:
    """One run of a case: printed, appended to var/faults-summary.txt, kept for `report`."""
    line = " ".join(f"{k}={v}" for k, v in summary.items())
    print(f"\nFAULT {name}: {line} recovery_s={recovery_s:.1f}")
    (ROOT / "var").mkdir(exist_ok=True)
    with open(ROOT / "var" / "faults-summary.txt", "a") as out:
        out.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {name}: {line} recovery_s={recovery_s:.1f}\n")
    RUNS[name].append({**summary, "recovery_s": round(recovery_s, 2)})


def report(path: Path) -> dict[str, dict[str, Any]]:
    """Per case: runs, lost, duplicated and resubmitted (summed over runs), recovery median and max; printed as a
    table and written to `path` as JSON."""
    table: dict[str, dict[str, Any]] = {}
    for name, runs in RUNS.items():
        times = [r["recovery_s"] for r in runs]
        table[name] = {"runs": len(runs), "lost": sum(int(r.get("lost", 0)) for r in runs),
                       "duplicated": sum(int(r.get("duplicated", 0)) for r in runs),
                       "resubmitted": sum(int(r.get("resubmitted", 0)) for r in runs),
                       "recovery_s_median": round(statistics.median(times), 2), "recovery_s_max": max(times),
                       "recovery_s": times}
    if table:
        print("\n\nFAULT SUMMARY (lost and duplicated summed over runs; recovery in seconds)")
        print(f"{'case':<28} {'runs':>4} {'lost':>5} {'dup':>5} {'resub':>5} {'median':>8} {'max':>8}")
        for name, row in table.items():
            print(f"{name:<28} {row['runs']:>4} {row['lost']:>5} {row['duplicated']:>5} {row['resubmitted']:>5} "
                  f"{row['recovery_s_median']:>8.1f} {row['recovery_s_max']:>8.1f}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "cases": table}, indent=2) + "\n")
    return table




def jobs(n: int, seed: int) -> list[list[str]]:
    corpus = CommentCorpus(seed)
    return [corpus.texts(1 + i % 3) for i in range(n)]


def running_batch_pid(url: str, timeout: float = 30, among: Callable[[], list[int]] | None = None) -> int:
    """The pid of a pool process that has a batch in progress (from the STARTED meta it stored); with
    `among`, one of the pids it returns (one worker's pool processes)."""
    client = redis.Redis.from_url(url)
    found: list[int] = []

    def started() -> bool:
        allowed = set(among()) if among is not None else None
        for key in client.scan_iter("celery-task-meta-*", count=500):
            raw = client.get(key)
            meta = json.loads(raw) if raw else {}
            if meta.get("status") == "STARTED" and (allowed is None or meta["batch"]["pid"] in allowed):
                found.append(meta["batch"]["pid"])
                return True
        return False

    wait_for(started, timeout, "a batch to start", interval=0.02)
    return found[0]


def batch_task_ids(url: str, pid: int) -> list[str]:
    """Task ids of the requests stored as STARTED by the batch running in pool process `pid`."""
    client = redis.Redis.from_url(url)
    ids = []
    for key in client.scan_iter("celery-task-meta-*", count=500):
        raw = client.get(key)
        meta = json.loads(raw) if raw else {}
        if meta.get("status") == "STARTED" and meta["batch"]["pid"] == pid:
            ids.append(meta["task_id"])
    return ids


def batch_pid(url: str, task_id: str) -> int | None:
    """The pool process whose batch stored this task's final result."""
    raw = redis.Redis.from_url(url).get(f"celery-task-meta-{task_id}")
    return json.loads(raw)["batch"]["pid"] if raw else None
