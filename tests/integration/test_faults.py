"""Fault tests: real worker processes, a real Redis (with AOF, as deployed), the real API, real faults.

Each test submits a load of jobs over HTTP, injects one fault, then checks that **every submitted job
ends succeeded or failed-with-a-reason**, that every succeeded job's scores equal Detoxify's own, and
that no task published two final results (an observer counts every result publication in Redis).
Each prints one summary line; `make test-faults` shows them. `FAULT_REPEATS` (1 unless set; 5 in
`make test-faults`) runs every case that many times, and the module ends with a table per case: lost
and duplicated over all runs, recovery time median and max (also written to var/faults.json).

They run on the full-size `unbiased-small` architecture (random weights), so that a batch takes long
enough (about a second) for a fault to land in the middle of it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from kombu.transport.redis import Channel as KombuChannel

from fleet.celeryconf import DEFAULT_VISIBILITY_TIMEOUT
from fleet.corpus import CommentCorpus
from fleet.keys import LEASE_PREFIX, UNACKED_KEY
from testing import (
    ROOT,
    Proc,
    RedisServer,
    child_pids,
    start_api,
    start_worker,
    synthetic_checkpoint,
    wait_for,
)
from testing.faults import (
    ExecutionLog,
    Load,
    ResultObserver,
    batch_pid,
    batch_task_ids,
    held_task_ids,
    jobs,
    measure,
    running_batch_pid,
    summarize,
    task_summary,
)
from testing.services import execution_log
from toxfleet import contract

pytestmark = pytest.mark.faults

VISIBILITY = str(DEFAULT_VISIBILITY_TIMEOUT)
"""Visibility timeout for these tests: the shipped default, so the recovery measured is the one deployed."""

SPLIT_ACROSS_WORKERS = True
"""Each case starts its own Redis, API and workers and mostly waits (redelivery, restarts): under
`make test`'s xdist they run side by side (tests/conftest.py)."""

WORKER_FAULT_BOUND_S = 150.0
"""The README's outer bound on a worker fault (from the fault to the final status of the last job it
hit), asserted by each worker fault case. Redelivery itself is bounded tighter (visibility timeout +
kombu's 5 s restore scan, asserted where a case sees it); the rest is scoring the restored requests,
which a loaded 2-core machine stretches several-fold (docs/reliability.md: 29.1 s quiet, 95 s loaded)."""


@pytest.fixture(scope="module")
def full_checkpoint() -> tuple[Path, Path]:
    return synthetic_checkpoint("unbiased-small")


@pytest.fixture(scope="module")
def reference(full_checkpoint: tuple[Path, Path]) -> Any:
    import torch
    from detoxify import Detoxify

    torch.set_num_threads(1)
    return Detoxify(checkpoint=str(full_checkpoint[0]), huggingface_config_path=str(full_checkpoint[1]))


def check_scores(load: Load, reference: Any) -> None:
    for job_id, body in load.bodies.items():
        if body["status"] != "succeeded":
            continue
        expected = reference.predict(load.texts[job_id])
        for i, row in enumerate(body["results"]):
            for label, value in row.items():
                want = expected[label][i] if len(load.texts[job_id]) > 1 else expected[label]
                assert value == pytest.approx(want, abs=1e-4), (job_id, i, label)


@pytest.fixture
def env(aof_redis: RedisServer, full_checkpoint: tuple[Path, Path], tmp_path: Path) -> Iterator[dict[str, Any]]:
    (ROOT / "var").mkdir(exist_ok=True)
    observer = ResultObserver(aof_redis.url)
    observer.start()
    assert observer.subscribed.wait(5)
    api, url = start_api(tmp_path, aof_redis.url, TOXFLEET_VISIBILITY_TIMEOUT=VISIBILITY)
    procs: list[Proc] = [api]
    yield {"redis": aof_redis, "ckpt": full_checkpoint, "tmp": tmp_path, "api": url, "observer": observer,
           "procs": procs, "log": ExecutionLog(execution_log(tmp_path))}
    observer.stopped.set()
    for p in reversed(procs):
        p.stop()


def worker(env: dict[str, Any], name: str, concurrency: int = 2, **extra: str) -> Proc:
    proc = start_worker(env["tmp"], env["redis"].url, env["ckpt"], name=name, concurrency=concurrency,
                        env={"TOXFLEET_VISIBILITY_TIMEOUT": VISIBILITY, **extra})
    env["procs"].append(proc)
    return proc


def celery_client(url: str) -> Any:
    """A Celery app that calls the scoring task directly, as a Python caller would (JSON only)."""
    from celery import Celery

    app = Celery(broker=url, backend=url)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    return app


def test_sigkill_pool_process_mid_batch(attempt: int, env: dict[str, Any], reference: Any) -> None:
    """The OOM killer takes a pool process mid-batch: its requests are re-published and complete."""
    w = worker(env, "kill-child")
    load = Load(env["api"])
    load.submit(jobs(40, 1))
    pid = running_batch_pid(env["redis"].url)
    holding = batch_task_ids(env["redis"].url, pid)
    assert holding, "the batch caught running held no request"
    env["log"].wait_for_batch(pid, holding)  # it is scoring them: the kill lands on work in flight
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    load.settle(300)
    s = summarize("sigkill-pool-process", load, env["observer"], env["log"], t0, affected_tasks=holding)
    assert s["lost"] == 0 and s["changed"] == 0 and s["succeeded"] == 40, s
    assert s["affected"] > 0 and s["rescored"] > 0, f"the kill missed the batch, or the record is blind: {s}"
    assert s["recovery_s"] <= WORKER_FAULT_BOUND_S, s
    assert "worker process lost" in w.output()
    check_scores(load, reference)


def test_sigkill_whole_worker_then_replacement(attempt: int, env: dict[str, Any], reference: Any) -> None:
    """A whole worker (main process and pool) is SIGKILLed mid-load; a replacement finishes its jobs
    within the visibility timeout plus the restore scan plus one batch: the dead worker's messages
    stop being renewed, and the leases its batch held (half a timeout) have expired by the time
    they come back, so no request is deferred for a second timeout."""
    first = worker(env, "doomed")
    load = Load(env["api"])
    load.submit(jobs(40, 2))
    assert first.proc is not None
    parent = first.proc.pid
    pid = running_batch_pid(env["redis"].url, among=lambda: child_pids(parent))
    env["log"].wait_for_batch(pid, batch_task_ids(env["redis"].url, pid))
    client = redis.Redis.from_url(env["redis"].url)
    dead_held = held_task_ids(client)  # every unacked message is the doomed worker's: the only one
    os.killpg(first.proc.pid, signal.SIGKILL)
    t0, killed_at = time.monotonic(), time.time()
    # Every unacked message is the dead worker's until the replacement starts consuming: watch for
    # the moment the last of them has been restored. A restored message keeps its delivery tag, so
    # "restored" is: its entry in kombu's unacked index is gone (back in the queue) or carries a
    # delivery time after the kill (delivered again); the dead worker's renewals all predate it.
    index = KombuChannel.unacked_index_key
    held = list(client.hkeys(UNACKED_KEY))
    assert held, "the killed worker held no message"
    restored_after: list[float] = []

    def watch() -> None:
        left = set(held)
        while left:
            tags = list(left)
            with client.pipeline(transaction=False) as pipe:
                for tag in tags:
                    pipe.zscore(index, tag)
                scores = pipe.execute()
            left = {tag for tag, score in zip(tags, scores, strict=True) if score is not None and score <= killed_at}
            time.sleep(0.1)
        restored_after.append(time.monotonic() - t0)

    threading.Thread(target=watch, daemon=True).start()
    replacement = worker(env, "replacement")
    load.settle(300)
    s = summarize("sigkill-whole-worker", load, env["observer"], env["log"], t0, affected_tasks=dead_held,
                  held_messages=len(held), restored_s=round(restored_after[0], 2) if restored_after else None)
    assert s["lost"] == 0 and s["changed"] == 0 and s["succeeded"] == 40, s
    assert s["affected"] > 0 and s["rescored"] > 0, f"the kill missed the batch, or the record is blind: {s}"
    assert restored_after, "the dead worker's messages were never restored"
    # The bound (docs/reliability.md) is visibility + 5 s (restore scan) + one batch. Its first part
    # is the mechanism's and is held tightly (3 s for a scan delayed on a loaded host); the batch of the
    # restored requests is CPU, allowed 90 s: at load 11-12, with the suite on two processes, the
    # replacement scored them in two batches of 29 and 32 texts that took 50 and 57 s.
    assert restored_after[0] < float(VISIBILITY) + 5 + 3, restored_after
    assert s["recovery_s"] <= WORKER_FAULT_BOUND_S, s
    assert "deferred" not in replacement.output()  # no claimed request came back before its lease expired
    check_scores(load, reference)


def test_delivery_leased_to_a_dead_batch_is_not_lost(attempt: int, env: dict[str, Any], reference: Any) -> None:
    """A request arrives while its lease is still held by a batch whose worker died (the lease outlives
    the holder by up to half a visibility timeout; a copy published again, by the sweeper or a retry,
    may arrive in that time): the delivery is left unacked and no longer renewed, Redis redelivers it
    once the lease has expired, and it succeeds. Acking it instead lost the job (a CI run caught that)."""
    visibility = 5
    w = worker(env, "heir", concurrency=1, TOXFLEET_VISIBILITY_TIMEOUT=str(visibility))
    client = redis.Redis.from_url(env["redis"].url)
    task_id = "dead-lease-" + os.urandom(4).hex()
    client.set(LEASE_PREFIX + task_id, "batch-of-a-dead-worker", ex=max(visibility // 2, 2))  # lease_seconds
    app = celery_client(env["redis"].url)
    texts = CommentCorpus(14).texts(2)
    t0 = time.monotonic()
    result = app.send_task(contract.SCORE_TASK, args=[texts], queue=contract.QUEUE, task_id=task_id)
    scores = result.get(timeout=4 * visibility + 20)
    waited = time.monotonic() - t0
    s = task_summary("dead-lease", client, [task_id], env["observer"], env["log"], t0)
    assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0 and s["affected"] == 1, s
    assert f"request {task_id} deferred" in w.output()
    assert waited >= visibility  # it really waited for the redelivery, not for the first delivery
    expected = reference.predict(texts)
    for i, row in enumerate(scores):
        for label, value in row.items():
            assert value == pytest.approx(expected[label][i], abs=1e-4), (i, label)


def _unacked_tags(client: redis.Redis, task_ids: set[str]) -> dict[str, bytes]:
    """Task id -> delivery tag, for those of `task_ids` whose message kombu holds as unacked (delivered
    to a worker, not acked)."""
    tags = {}
    for tag, raw in client.hscan_iter(UNACKED_KEY, count=500):
        task_id = json.loads(raw)[0]["headers"]["id"]
        if task_id in task_ids:
            tags[task_id] = tag
    return tags


def test_a_slow_batch_of_a_live_worker_is_not_redelivered(attempt: int, env: dict[str, Any],
                                                          reference: Any) -> None:
    """A worker whose batch runs far longer than the visibility timeout keeps its messages, the batch's
    and those waiting in its buffer, for as long as its main process lives: a second, idle worker
    never receives them, nothing is scored twice, and each result comes from the slow worker.

    The batch is made slow by freezing its pool process (SIGSTOP) for 4 visibility timeouts and more,
    the worst a loaded host can do: the pool's own lease renewals stop too, so the leases lapse and
    only the main process's renewal of the messages in kombu's unacked index stands between them and
    a redelivery that a second batch would claim and score. Without that renewal, the idle worker's
    restore scan would hand them out one visibility timeout after delivery."""
    visibility = 5
    slow = worker(env, "slow", concurrency=1, TOXFLEET_VISIBILITY_TIMEOUT=str(visibility))
    assert slow.proc is not None
    client = redis.Redis.from_url(env["redis"].url)
    index = KombuChannel.unacked_index_key  # kombu's own name for it (no transport option changes it here)
    # A publisher with no result backend: results are read from Redis below, so no AsyncResult stays
    # subscribed to a Redis that the fixture stops.
    from celery import Celery

    app = Celery(broker=env["redis"].url)
    app.conf.update(task_serializer="json", accept_content=["json"])
    corpus = CommentCorpus(15)
    ids = [f"slow-{attempt}-{i}-{os.urandom(3).hex()}" for i in range(4)]
    # The first is long enough for its batch to be caught running; the others wait in the buffer.
    texts = {t: corpus.texts(40 if i == 0 else 2) for i, t in enumerate(ids)}
    for t in ids:
        app.send_task(contract.SCORE_TASK, args=[texts[t]], queue=contract.QUEUE, task_id=t)
    pid = running_batch_pid(env["redis"].url, among=lambda: child_pids(slow.proc.pid))  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: len(_unacked_tags(client, set(ids))) == len(ids), 30, "the slow worker to hold every message")
        tags = _unacked_tags(client, set(ids))
        idle = worker(env, "idle", concurrency=1, TOXFLEET_VISIBILITY_TIMEOUT=str(visibility))
        # Frozen for 4 timeouts at least, and for 2 timeouts and 2 restore scans after the idle worker
        # is up (its restore scan is what would redeliver them; it runs every 5 s).
        until = max(frozen_at + 4 * visibility, time.monotonic() + 2 * visibility + 10)
        oldest = 0.0
        lease_lapsed = False
        while time.monotonic() < until:
            now = time.time()
            for t, tag in tags.items():
                score = client.zscore(index, tag)
                assert score is not None and client.hexists(UNACKED_KEY, tag), f"{t}'s message was redelivered"
                oldest = max(oldest, now - score)
            assert not any(client.llen(q) for q in contract.QUEUES), "a message went back to a queue"
            lease_lapsed = lease_lapsed or not client.exists(LEASE_PREFIX + ids[0])
            time.sleep(0.5)
        held_for = time.monotonic() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: all(env["observer"].finals[t] >= 1 for t in ids), 120, "every result")
    metas = [json.loads(cast(bytes, client.get(f"celery-task-meta-{t}"))) for t in ids]
    assert [m["status"] for m in metas] == ["SUCCESS"] * len(ids), metas
    outcomes = [m["result"] for m in metas]
    s = task_summary("slow-batch-held", client, ids, env["observer"], env["log"], frozen_at,
                     held_s=round(held_for, 1), oldest_renewal_s=round(oldest, 1))
    # Scored once each, by the slow worker: the batch frozen mid-way and its buffer were never handed out.
    assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0 and s["affected"] == len(ids), s
    assert env["log"].executions()[ids[0]] == 1 and any(e["pid"] == pid for e in env["log"].entries())
    assert lease_lapsed, "the frozen batch's lease should have lapsed: only the message renewal kept it"
    assert oldest < visibility, oldest
    slow_pids = set(child_pids(slow.proc.pid))
    assert batch_pid(env["redis"].url, ids[0]) == pid
    assert all(batch_pid(env["redis"].url, t) in slow_pids for t in ids)
    assert not any(t in idle.output() for t in ids) and "deferred" not in idle.output()
    for t, scores in zip(ids, outcomes, strict=True):
        expected = reference.predict(texts[t])
        for i, row in enumerate(scores):
            for label, value in row.items():
                assert value == pytest.approx(expected[label][i], abs=1e-4), (t, i, label)


def test_message_popped_by_a_dying_worker_is_recovered(attempt: int, env: dict[str, Any], reference: Any) -> None:
    """kombu takes a message off the queue (BRPOP) before it records it as unacked; a worker killed in
    between leaves it nowhere (celery/celery#7950; this lost a job in CI). Here that pop is done by
    hand, with no worker running: the worker started next finds the job's message lost, re-publishes
    it from the API's pending record, and the job succeeds."""
    load = Load(env["api"])
    load.submit(jobs(3, 7))
    client = redis.Redis.from_url(env["redis"].url)
    popped = cast(bytes | None, client.rpop(contract.QUEUE))  # the oldest message: delivered, for Redis
    assert popped is not None and client.llen(contract.QUEUE) == 2
    lost_task = json.loads(popped)["headers"]["id"]
    t0 = time.monotonic()
    w = worker(env, "sweeper", TOXFLEET_SWEEP_SECONDS="1")
    load.settle(60)
    s = summarize("popped-then-killed", load, env["observer"], env["log"], t0, affected_tasks=[lost_task])
    assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0 and s["succeeded"] == 3, s
    assert s["affected"] == 1, s
    assert f"task {lost_task}: its message was lost by Redis" in w.output()
    check_scores(load, reference)


def test_sigterm_mid_batch_hands_work_back(attempt: int, env: dict[str, Any], reference: Any) -> None:
    """Scale-in: SIGTERM a worker mid-batch; in-flight batches finish, buffered requests go back to the
    queue, and the remaining worker completes everything."""
    stays = worker(env, "stays", concurrency=1)
    leaves = worker(env, "leaves", concurrency=1)
    load = Load(env["api"])
    load.submit(jobs(40, 3))
    assert leaves.proc is not None
    parent = leaves.proc.pid
    # The case is only shown if the leaving worker is the one holding a batch when the signal lands.
    held_by = running_batch_pid(env["redis"].url, among=lambda: child_pids(parent))
    holding = batch_task_ids(env["redis"].url, held_by)
    env["log"].wait_for_batch(held_by, holding)
    in_flight = held_task_ids(redis.Redis.from_url(env["redis"].url))
    t0 = time.monotonic()
    leaves.signal(signal.SIGTERM)
    leaves.proc.wait(60)
    load.settle(300)
    s = summarize("sigterm-mid-batch", load, env["observer"], env["log"], t0, affected_tasks=in_flight)
    # A warm shutdown finishes its batch and hands back what it had not started: nothing scored twice.
    assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0 and s["succeeded"] == 40, s
    assert s["affected"] > 0 and s["recovery_s"] <= WORKER_FAULT_BOUND_S, s
    assert stays.alive()
    # The batch in flight at the signal finished in the leaving worker before it exited (warm shutdown).
    assert holding and all(batch_pid(env["redis"].url, t) == held_by for t in holding), holding
    check_scores(load, reference)


@pytest.mark.parametrize("how", ["restart", "kill-9"])
def test_redis_restart_during_load(attempt: int, how: str, env: dict[str, Any], reference: Any) -> None:
    """Redis goes down in the middle of a load, stopped or killed -9, and comes back with the shipped
    persistence (AOF, appendfsync everysec): workers reconnect and keep consuming; jobs sent before,
    while it is down (answered 503, retried as documented, accepted once it is back) and after all
    complete. A graceful restart loses nothing. A killed one may lose the last acknowledged writes:
    with everysec, Redis and Valkey postpone writing to the AOF (up to 2 s) while a background fsync is
    still running, yet reply meanwhile (Valkey 9.1 here lost 3 of 50 jobs once). Those jobs answer 404,
    and are submitted again as the official client does: none is lost."""
    worker(env, "survivor")
    load = Load(env["api"])
    load.submit(jobs(30, 4))
    pid = running_batch_pid(env["redis"].url)
    env["log"].wait_for_batch(pid, batch_task_ids(env["redis"].url, pid))
    t0 = time.monotonic()
    if how == "kill-9":
        env["redis"].kill()
    else:
        env["redis"].stop()
    during = Load(env["api"])
    submitter = threading.Thread(target=during.submit, args=(jobs(10, 5),), daemon=True)
    submitter.start()
    # Down for real: submits made now are refused, and only its return lets them in.
    wait_for(lambda: during.refused[503] >= 1, 10, "a submit answered 503 while Redis is down", interval=0.02)
    down_s = time.monotonic() - t0
    env["redis"].start()
    submitter.join(60)
    assert not submitter.is_alive() and len(during.texts) == 10, during.refused
    assert set(during.refused) == {503}, during.refused  # never a 500 or a hang
    hit = [*load.texts, *during.texts]
    load.merge(during)
    load.settle(300, resubmit=how == "kill-9")
    after = Load(env["api"])  # a consumer that silently stopped after the reconnect would fail here
    after.submit(jobs(10, 6))
    after.settle(60)
    load.merge(after)
    s = summarize(f"redis-{how}", load, env["observer"], env["log"], t0, affected_tasks=hit, down_s=round(down_s, 2))
    assert s["lost"] == 0 and s["changed"] == 0 and s["succeeded"] == 50, s
    assert s["affected"] > 0 and s["refused"] > 0, s
    check_scores(load, reference)


def test_redis_down_api_answers_503_fast(attempt: int, env: dict[str, Any]) -> None:
    """With Redis stopped, the API answers 503 + Retry-After within a second instead of hanging, and is
    ready again once Redis is back (the case's recovery: from Redis's return to `/readyz` 200)."""
    env["redis"].stop()
    t0 = time.monotonic()
    r = httpx.post(env["api"] + "/v1/jobs", json={"texts": ["hello"]}, timeout=10)
    elapsed = time.monotonic() - t0
    assert r.status_code == 503 and "retry-after" in r.headers and elapsed < 1.0
    assert httpx.get(env["api"] + "/readyz", timeout=10).status_code == 503
    env["redis"].start()
    back = time.monotonic()
    wait_for(lambda: httpx.get(env["api"] + "/readyz", timeout=2).status_code == 200, 10, "readiness after Redis")
    accepted = [str(r.json()["id"])] if r.status_code == 202 else []
    measure("redis-down-503", accepted=accepted, final={}, observed={}, rescored=env["log"].rescored(),
            changed=len(env["observer"].changed), fault_at=back, recovered_at=time.monotonic(),
            refused=int(r.status_code == 503), answer_s=round(elapsed, 3))


@pytest.fixture
def poison_checkpoint(tiny_checkpoint: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, int]:
    """The tiny checkpoint with its embedding table cut short, so a text containing a rare token makes
    the model itself raise (IndexError in the embedding lookup), as a tokenizer/model mismatch would."""
    import shutil

    import torch

    keep = 600
    hf = tmp_path / "poison-hf"
    shutil.copytree(tiny_checkpoint[1], hf)
    config = json.loads((hf / "config.json").read_text())
    config["vocab_size"] = keep
    (hf / "config.json").write_text(json.dumps(config))
    ckpt = torch.load(tiny_checkpoint[0], weights_only=False)
    sd = ckpt["state_dict"]
    for name in list(sd):
        if name.endswith("word_embeddings.weight") or name.endswith("predictions.decoder.weight"):
            sd[name] = sd[name][:keep].clone()
        if name.endswith("predictions.bias") or name.endswith("predictions.decoder.bias"):
            sd[name] = sd[name][:keep].clone()
    ckpt["config"]["arch"]["args"]["model_type"] = str(hf)
    path = tmp_path / "poison.ckpt"
    torch.save(ckpt, path)
    return path, hf, keep


def test_poison_text_fails_only_its_job(attempt: int, poison_checkpoint: tuple[Path, Path, int],
                                        aof_redis: RedisServer, tmp_path: Path) -> None:
    """A text that makes the model raise fails its own job with the reason; jobs batched with it succeed."""
    from transformers import AlbertTokenizer

    ckpt, hf, keep = poison_checkpoint
    tok = AlbertTokenizer.from_pretrained(hf)
    corpus = CommentCorpus(9)
    good: list[str] = []
    bad: list[str] = []
    while len(good) < 20 or len(bad) < 3:
        text = corpus.text()[:200]
        (bad if max(tok(text)["input_ids"]) >= keep else good).append(text)
    observer = ResultObserver(aof_redis.url)
    observer.start()
    assert observer.subscribed.wait(5)
    w = start_worker(tmp_path, aof_redis.url, (ckpt, hf), name="poisoned")
    api, url = start_api(tmp_path, aof_redis.url)
    assert w.proc is not None
    children = child_pids(w.proc.pid)
    try:
        # Freeze the pool: two jobs occupy its two processes, the rest wait in the worker's buffer
        # and go out together as one batch of good and bad texts when the pool thaws.
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        load = Load(url)
        load.submit([[t] for t in good[:2]])
        time.sleep(1)
        # In order, a poison text ahead of every six good ones: whichever share of the buffer the
        # first thawed process takes, it holds a poison text and good ones together.
        mixed = [t for k in range(3) for t in [bad[k], *good[2 + 6 * k: 8 + 6 * k]]]
        load.submit([[t] for t in mixed], threads=1)
        time.sleep(1)
        for pid in children:
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        load.settle(60)
        s = summarize("poison-text", load, observer, ExecutionLog(execution_log(tmp_path)), t0)
        # Its batch retried the requests one by one in place: none was claimed, so scored, twice.
        assert s["lost"] == 0 and s["rescored"] == 0 and s["changed"] == 0, s
        assert s["succeeded"] == 20 and s["failed"] == 3 and s["failed_without_reason"] == 0, s
        # Every job's final result was seen: the observer really watched (a count of zero proves nothing).
        wait_for(lambda: all(observer.finals[contract.chunk_task_id(j, 0)] >= 1 for j in load.texts), 10,
                 "the observer to see every final result")
        for job_id, texts in load.texts.items():
            body = load.bodies[job_id]
            if texts[0] in bad:
                assert body["status"] == "failed" and "IndexError" in body["error"], body
        assert "retrying one by one" in w.output()
    finally:
        observer.stopped.set()
        api.stop()
        w.stop()


def test_crash_retries_are_bounded(attempt: int, env: dict[str, Any]) -> None:
    """A request whose pool process keeps dying is retried max_retries times, then fails with a reason
    instead of requeueing forever."""
    worker(env, "crashy", concurrency=1, TOXFLEET_MAX_RETRIES="1")

    app = celery_client(env["redis"].url)
    long_texts = CommentCorpus(12).texts(200)
    result = app.send_task(contract.SCORE_TASK, args=[long_texts], queue=contract.QUEUE)
    killed = set()
    t0 = time.monotonic()
    for _ in range(2):  # the first attempt and the one retry each lose their process
        pid = running_batch_pid(env["redis"].url, timeout=60)
        while pid in killed:
            time.sleep(0.05)
            pid = running_batch_pid(env["redis"].url, timeout=60)
        env["log"].wait_for_batch(pid, [result.id], timeout=30)  # the kill lands on its scoring
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        redis.Redis.from_url(env["redis"].url).delete(f"celery-task-meta-{result.id}")
    with pytest.raises(RuntimeError, match="gave up after 2 attempts"):
        result.get(timeout=60)
    s = task_summary("crash-retries", redis.Redis.from_url(env["redis"].url), [result.id], env["observer"],
                     env["log"], t0)
    # Both kills landed on its scoring: the record holds the first attempt and the retry, and no third.
    assert env["log"].executions()[result.id] == 2 and s["rescored"] == 1, (env["log"].entries(), s)
    assert s["lost"] == 0 and s["changed"] == 0, s
