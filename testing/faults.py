"""What the fault suite and the soak share: an observer of final results, the workers' own record of
each scoring execution, a load of jobs over HTTP, the per-case figures of repeated fault runs, and
where a worker's batches run.

Every figure of a case is measured, per run, then `record`ed; `report` sums them per case and writes
`var/faults.json`:

- `jobs`: jobs (or directly sent tasks) the service accepted;
- `lost`: accepted jobs that never reached a final status a client could read;
- `rescored`: requests (task ids; a resubmitted job's under its original job id) that the workers
  scored more than once, counted from their execution record (`ExecutionLog`), not from results;
- `changed`: requests whose final result, once read, later read (or was published) differently;
- `recovery_s`: from the fault to the final status of the last job it affected;
- `observer_missed`: final results a client read that the observer never saw published (a finding:
  it shows where the observer was blind, a Redis down or a failover; the count is not patched).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import platform
import statistics
import subprocess
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from fleet import redis_url as urls
from fleet.corpus import CommentCorpus
from fleet.keys import UNACKED_KEY
from testing.processes import ROOT, wait_for
from testing.scoring import BackgroundScore, _numbers, _strip, same_result
from toxfleet import contract
from toxfleet.client.protocol import Submission

FINAL = ("SUCCESS", "FAILURE")


class ResultObserver(threading.Thread):
    """Every final result Celery's backend publishes, per task id: how many times, when first (monotonic),
    what first, and which task ids were later published with a different outcome. Reconnects after a
    Redis restart; what is published while it is disconnected it cannot see."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.finals: Counter[str] = Counter()
        self.first_at: dict[str, float] = {}
        self.first: dict[str, tuple[str, Any]] = {}
        self.changed: set[str] = set()
        self.metas: dict[str, dict[str, Any]] = {}
        """Task id -> the last final result meta published for it (backend, batch, pool process)."""
        self.changes: dict[str, str] = {}
        """Task id -> how its later publication differed (`describe_change`), for the case's report."""
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
                        self.seen(json.loads(message["data"]))
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.2)

    def seen(self, meta: Mapping[str, Any]) -> None:
        if meta.get("status") not in FINAL:
            return
        task_id = str(meta["task_id"])
        outcome = (str(meta["status"]), meta.get("result"))
        self.finals[task_id] += 1
        self.metas[task_id] = dict(meta)
        if task_id not in self.first:
            self.first_at[task_id] = time.monotonic()
            self.first[task_id] = outcome
        elif not same_result(self.first[task_id], outcome):
            self.changed.add(task_id)
            self.changes.setdefault(task_id, describe_change(self.first[task_id], outcome))



@contextlib.contextmanager
def observing(url: str) -> Iterator[ResultObserver]:
    """A `ResultObserver` on `url`, subscribed before the block runs and stopped after it."""
    results = ResultObserver(url)
    results.start()
    try:
        assert results.subscribed.wait(10), "the observer could not subscribe"
        yield results
    finally:
        results.stopped.set()
        results.join(5)

def describe_change(first: Any, later: Any) -> str:
    """How two readings of one final result differ: whether only numbers moved (and by how much at
    most), or its shape or text did."""
    a, b = _numbers(first), _numbers(later)
    if len(a) == len(b) and json.dumps(_strip(first)) == json.dumps(_strip(later)):
        return f"numbers only, max |diff| {max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0):.2e}"
    return f"{json.dumps(first, default=str)[:160]} -> {json.dumps(later, default=str)[:160]}"


@dataclass
class ExecutionLog:
    """The workers' own record of each scoring execution (`TOXFLEET_EXECUTION_LOG`, worker/executions.py):
    one line per batch, written before it scores, naming the requests it claimed."""

    path: Path

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill -9 mid-write
                continue
        return out

    def executions(self, canonical: Callable[[str], str] = lambda t: t) -> Counter[str]:
        """Scoring executions per request (task ids mapped through `canonical`)."""
        return Counter(canonical(t) for e in self.entries() for t in e["tasks"])

    def rescored(self, canonical: Callable[[str], str] = lambda t: t) -> int:
        """Requests scored more than once."""
        return sum(1 for n in self.executions(canonical).values() if n > 1)

    def wait_for_batch(self, pid: int, task_ids: Iterable[str], timeout: float = 10) -> dict[str, Any]:
        """The line of pool process `pid`'s batch that claimed any of `task_ids` (it is scoring them)."""
        wanted = set(task_ids)
        found: list[dict[str, Any]] = []

        def logged() -> bool:
            found[:] = [e for e in self.entries() if e["pid"] == pid and wanted & set(e["tasks"])]
            return bool(found)

        wait_for(logged, timeout, f"pool process {pid}'s batch in the execution log", interval=0.02)
        return found[-1]


@dataclass
class Load:
    """A set of jobs submitted over HTTP, each under its own Idempotency-Key, and what became of them."""

    api: str
    texts: dict[str, list[str]] = field(default_factory=dict)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    read_at: dict[str, float] = field(default_factory=dict)
    """Job id -> when its final status was first read (monotonic)."""
    submissions: dict[str, Submission] = field(default_factory=dict)
    original: dict[str, str] = field(default_factory=dict)
    """A resubmitted job's id -> the id it was first accepted under."""
    resubmitted: int = 0
    """Jobs that answered 404 (gone with the broker) and were submitted again, as the official client does."""
    refused: Counter[int] = field(default_factory=Counter)
    """Submits answered other than 202 (503 while Redis is down), per status; retried, as documented."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _post(self, submission: Submission) -> str:
        for _ in range(100):
            try:
                r = httpx.post(self.api + "/v1/jobs", json=submission.body, headers=submission.headers(), timeout=10)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code == 202:
                return str(r.json()["id"])
            with self.lock:
                self.refused[r.status_code] += 1
            time.sleep(0.2)  # 503 while Redis restarts: the client retries, as documented
        raise AssertionError(f"could not submit: {r.status_code} {r.text}")

    def submit(self, jobs: list[list[str]], threads: int = 8) -> None:
        """Submit every job (`threads` at a time: with 1, in order)."""
        def post(texts: list[str]) -> tuple[str, Submission]:
            submission = Submission({"texts": texts}, uuid.uuid4().hex)
            return self._post(submission), submission

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for job_id, submission in pool.map(post, jobs):
                with self.lock:
                    self.texts[job_id] = submission.body["texts"]
                    self.submissions[job_id] = submission

    def merge(self, other: Load) -> None:
        """Take in another load's jobs (one case, several waves of submits)."""
        self.texts.update(other.texts)
        self.bodies.update(other.bodies)
        self.read_at.update(other.read_at)
        self.submissions.update(other.submissions)
        self.original.update(other.original)
        self.resubmitted += other.resubmitted
        self.refused.update(other.refused)

    def settle(self, deadline_s: float, resubmit: bool = False) -> None:
        """Poll every job until it is final or the deadline passes. A job that answers 404 is lost,
        unless `resubmit`: then it is submitted again under its Idempotency-Key and polled in turn."""
        deadline = time.monotonic() + deadline_s
        pending = set(self.texts) - set(self.bodies)
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                try:
                    r = httpx.get(f"{self.api}/v1/jobs/{job_id}", params={"wait": 1}, timeout=10)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if r.status_code == 200 and r.json()["status"] in ("succeeded", "failed"):
                    self.bodies[job_id] = r.json()
                    self.read_at[job_id] = time.monotonic()
                    pending.discard(job_id)
                elif r.status_code == 404 and resubmit:
                    pending.discard(job_id)
                    pending.add(self._again(job_id))
                elif r.status_code == 404:
                    pending.discard(job_id)

    def _again(self, lost_id: str) -> str:
        submission = self.submissions.pop(lost_id)
        while not submission.answered(lost_id, new_id := self._post(submission), "answered 404"):
            pass
        self.texts[new_id] = self.texts.pop(lost_id)
        self.submissions[new_id] = submission
        self.original[new_id] = self.original.pop(lost_id, lost_id)
        self.resubmitted += 1
        return new_id

    def reread(self) -> tuple[dict[str, str], set[str]]:
        """Every job read final, read again: (job id -> how its status or results now differ, jobs now unknown)."""
        changed, vanished = {}, set()
        for job_id, body in self.bodies.items():
            r = httpx.get(f"{self.api}/v1/jobs/{job_id}", timeout=10)
            if r.status_code == 404:
                vanished.add(job_id)
            elif r.status_code != 200 or not same_result(_outcome(r.json()), _outcome(body)):
                now = _outcome(r.json()) if r.status_code == 200 else r.text
                changed[job_id] = describe_change(_outcome(body), now)
        return changed, vanished


def _outcome(body: Mapping[str, Any]) -> tuple[Any, ...]:
    return body.get("status"), body.get("results"), body.get("error")


def canonical_task(original: Mapping[str, str]) -> Callable[[str], str]:
    """Maps a task id of a resubmitted job to the same chunk of the job as first accepted."""
    def canonical(task_id: str) -> str:
        job = contract.job_of(task_id)
        return original.get(job, job) + task_id[len(job):]
    return canonical


def job_final_at(observer: ResultObserver, job_id: str, chunks: int) -> float | None:
    """When the observer saw the last of a job's chunks published final (None: it missed one)."""
    times = [observer.first_at.get(contract.chunk_task_id(job_id, i)) for i in range(chunks)]
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


def measure(name: str, *, accepted: Iterable[str], final: Mapping[str, float], observed: Mapping[str, float | None],
            rescored: int, changed: int, fault_at: float, affected: Iterable[str] | None = None,
            recovered_at: float | None = None, **extra: Any) -> dict[str, Any]:
    """One run's figures from what was seen per job: `accepted` job ids (under the id they ended
    with), `final` job id -> when a client read it final, `observed` job id -> when the observer saw
    it final (None: missed). A job's final time is the observer's, else the read. The jobs the fault
    hit are `affected` (the killed batch's, the dead worker's), else every job not final before
    `fault_at`; their count is returned (`affected`), for the case to assert that there were some.
    `recovered_at` overrides the end of the recovery, for a case with no job to end it."""
    accepted = list(accepted)
    lost = [j for j in accepted if j not in final]
    done_at = {j: (observed.get(j) or final[j]) for j in accepted if j in final}
    hit = set(accepted if affected is None else affected)
    affected = [j for j in accepted if j in hit and (j in lost or done_at[j] > fault_at)]
    last = max((done_at[j] for j in affected if j in done_at), default=fault_at)
    if recovered_at is not None:
        last = recovered_at
    figures = {"jobs": len(accepted), "lost": len(lost), "rescored": rescored, "changed": changed,
               "affected": len(affected), "observer_missed": sum(1 for j in final if observed.get(j) is None),
               **extra}
    record(name, figures, last - fault_at)
    return {**figures, "recovery_s": last - fault_at}


def noted(how: Mapping[str, str], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A case's extra figures, with how each changed result changed when one did (a finding)."""
    return {**extra, **({"changed_how": dict(how)} if how else {})}


def summarize(name: str, load: Load, observer: ResultObserver, log: ExecutionLog, fault_at: float,
              affected_tasks: Iterable[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A Load's run: lost from its reads, rescored from the execution log, changed from the observer
    and a second read of every final job, recovery from the fault to the last affected job's final."""
    observed = {j: job_final_at(observer, j, len(contract.chunk(t))) for j, t in load.texts.items()}
    changed, vanished = load.reread()
    changed.update({contract.job_of(t): f"published again: {how}" for t, how in observer.changes.items()})
    how = {j: h for j, h in changed.items() if j in load.texts}
    failed_without_reason = sum(1 for b in load.bodies.values() if b["status"] == "failed" and not b.get("error"))
    statuses = Counter(b["status"] for b in load.bodies.values())
    return measure(name, accepted=load.texts, final=load.read_at, observed=observed,
                   rescored=log.rescored(canonical_task(load.original)), changed=len(how),
                   fault_at=fault_at, affected=None if affected_tasks is None else affected_jobs(load, affected_tasks),
                   succeeded=statuses["succeeded"], failed=statuses["failed"],
                   failed_without_reason=failed_without_reason, vanished=len(vanished),
                   resubmitted=load.resubmitted, refused=sum(load.refused.values()),
                   **noted(how, extra))


def client_summary(name: str, load: BackgroundScore, observer: ResultObserver, log: ExecutionLog, fault_at: float,
                   api_url: str, **extra: Any) -> dict[str, Any]:
    """A `Client.score` run's figures, from what its `TrackingClient` saw: a submission (its first id
    and every resubmit under its key) is lost when none of its ids was read final."""
    client = load.client
    ended: dict[str, str] = {}
    observed: dict[str, float | None] = {}
    for key, ids in client.accepted.items():
        ended[key] = next((j for j in ids if j in client.final), ids[-1])
        observed[ended[key]] = job_final_at(observer, ended[key], len(contract.chunk(client.texts[key])))
    changed, vanished = client.reread(api_url)
    changed.update({contract.job_of(t): f"published again: {how}" for t, how in observer.changes.items()})
    how = {j: h for j, h in changed.items() if j in set(ended.values())}
    return measure(name, accepted=ended.values(), final={j: t for j, (t, _) in client.final.items()},
                   observed=observed, rescored=log.rescored(canonical_task(client.original())),
                   changed=len(how), fault_at=fault_at, vanished=len(vanished), reopened=len(client.reopened),
                   resubmitted=sum(len(ids) - 1 for ids in client.accepted.values()),
                   **noted(how, extra))


def affected_jobs(load: Load, task_ids: Iterable[str]) -> set[str]:
    """The jobs (under the ids they ended with) that these task ids belong to."""
    jobs = {contract.job_of(t) for t in task_ids}
    return {j for j in load.texts if load.original.get(j, j) in jobs}


def held_task_ids(client: redis.Redis) -> list[str]:
    """Task ids of the messages kombu holds as delivered and not acked (every worker's, buffered or scoring)."""
    return [json.loads(raw)[0]["headers"]["id"] for raw in client.hvals(UNACKED_KEY)]


def task_summary(name: str, client: redis.Redis, task_ids: list[str], observer: ResultObserver, log: ExecutionLog,
                 fault_at: float, **extra: Any) -> dict[str, Any]:
    """The same figures for tasks sent straight to Celery (each its own job), read from their result keys."""
    final: dict[str, float] = {}
    changed = set(observer.changed) & set(task_ids)
    for t in task_ids:
        raw = client.get(f"celery-task-meta-{t}")
        meta = json.loads(raw) if raw else {}
        if meta.get("status") in FINAL:
            final[t] = time.monotonic()
            if t in observer.first and observer.first[t] != (meta["status"], meta.get("result")):
                changed.add(t)
    return measure(name, accepted=task_ids, final=final, observed={t: observer.first_at.get(t) for t in task_ids},
                   rescored=log.rescored(), changed=len(changed), fault_at=fault_at, **extra)


RUNS: dict[str, list[dict[str, Any]]] = defaultdict(list)
"""Every recorded run of this process, per case."""


def record(name: str, figures: Mapping[str, Any], recovery_s: float) -> None:
    """One run of a case: printed, appended to var/faults-summary.txt, kept for `report`."""
    line = " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\nFAULT {name}: {line} recovery_s={recovery_s:.1f}")
    (ROOT / "var").mkdir(exist_ok=True)
    with open(ROOT / "var" / "faults-summary.txt", "a") as out:
        out.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {name}: {line} recovery_s={recovery_s:.1f}\n")
    RUNS[name].append({**figures, "recovery_s": round(recovery_s, 2)})


SUMMED = ("jobs", "lost", "rescored", "changed")
"""The figures of var/faults.json summed over a case's runs (besides its recovery median and max)."""

NOTED = ("observer_missed", "vanished", "resubmitted", "refused", "affected")
"""Further figures summed into a case's row when its runs measured them."""


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(path: Path) -> list[dict[str, Any]]:
    """Per case: runs; jobs, lost, rescored and changed summed over them; recovery median and max;
    printed as a table and written to `path` as `{"cases": [...]}`."""
    cases: list[dict[str, Any]] = []
    for name, runs in RUNS.items():
        times = [r["recovery_s"] for r in runs]
        row: dict[str, Any] = {"case": name, "runs": len(runs),
                               **{k: sum(int(r[k]) for r in runs) for k in SUMMED},
                               "recovery_s_median": round(statistics.median(times), 2), "recovery_s_max": max(times),
                               "recovery_s": times}
        row.update({k: sum(int(r[k]) for r in runs) for k in NOTED if all(k in r for r in runs)})
        cases.append(row)
    if cases:
        print("\n\nFAULT SUMMARY (counts summed over runs; recovery in seconds, from the fault to the last "
              "affected job's final status)")
        print(f"{'case':<26} {'runs':>4} {'jobs':>5} {'lost':>5} {'resc':>5} {'chg':>4} {'missed':>6} "
              f"{'median':>7} {'max':>7}")
        for row in cases:
            print(f"{row['case']:<26} {row['runs']:>4} {row['jobs']:>5} {row['lost']:>5} {row['rescored']:>5} "
                  f"{row['changed']:>4} {row.get('observer_missed', '-')!s:>6} {row['recovery_s_median']:>7.1f} "
                  f"{row['recovery_s_max']:>7.1f}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "cpu": cpu_model(), "cases": cases}, indent=2) + "\n")
    return cases


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
