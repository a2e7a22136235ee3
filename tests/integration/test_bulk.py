"""The user's side end to end, on a real fleet (Redis, a Celery worker on the tiny checkpoint, uvicorn):
the Python clients, the long-text windows mode, flags, the score cache, and the `toxfleet score` CLI
including resume after an interrupt. Scores are checked against Detoxify itself."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleet import cache as score_cache
from fleet.corpus import CommentCorpus
from testing import Fleet, FleetSpec, base_env, wait_for
from testing.scoring import assert_detoxify_scores
from toxfleet.client import AsyncClient, Client, InvalidRequest, Result

MODEL = "checkpoint:tiny/model.ckpt"
TOXFLEET = str(Path(sys.executable).parent / "toxfleet")  # the installed console script


FLEET = FleetSpec("bulk")


def scores(results: list[Result]) -> list[dict[str, float]]:
    return [r.scores for r in results]


def metric(url: str, name: str) -> float:
    """A sample's value in a Prometheus endpoint (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_client_scores_a_large_input_in_order(fleet: Fleet, tiny_detoxify: Any) -> None:
    """Client.score splits 150 texts into jobs, keeps several in flight, returns Detoxify's scores in
    order, each with flags at the default 0.5 threshold."""
    texts = CommentCorpus(31).texts(150)
    with Client(fleet.url) as c:
        results = c.score(texts, job_size=20, in_flight=4)
    assert_detoxify_scores(tiny_detoxify, texts, scores(results))
    for r in results:
        assert r.labels == {label: v >= 0.5 for label, v in r.scores.items()}
        assert r.flagged == any(r.labels.values())


def test_async_client_with_request_thresholds(fleet: Fleet, tiny_detoxify: Any) -> None:
    """AsyncClient scores the same way; per-request thresholds decide the flags (0: all, 1: none)."""
    texts = CommentCorpus(32).texts(12)

    async def go() -> tuple[list[Result], list[Result], Any]:
        async with AsyncClient(fleet.url) as c:
            low = await c.score(texts, thresholds={"toxicity": 0.0}, job_size=5)
            high = await c.score(texts, thresholds=1.0)
            job = await c.submit(texts[:2])
            return low, high, await job.wait(timeout=30)

    low, high, status = asyncio.run(go())
    assert_detoxify_scores(tiny_detoxify, texts, scores(low))
    assert all(r.labels is not None and r.labels["toxicity"] and r.flagged for r in low)
    assert not any(r.flagged for r in high)
    assert status.status == "succeeded" and status.model == MODEL and status.total == 2


def test_bad_threshold_is_a_clear_error(fleet: Fleet) -> None:
    """A threshold naming an unknown label is refused with 422 before anything is queued."""
    with Client(fleet.url) as c, pytest.raises(InvalidRequest, match="unknown label"):
        c.submit(["x"], thresholds={"toxic": 0.5})


def test_windows_mode_through_the_fleet(fleet: Fleet, tiny_detoxify: Any) -> None:
    """long_text="windows" over HTTP equals the scorer's windows in-process, and differs from the
    default, which equals Detoxify.predict (truncation)."""
    from worker.backends.torch import TorchBackend
    from worker.scorer import Scorer

    long_text = " ".join(CommentCorpus(33).texts(40))
    short = "a short one"
    with Client(fleet.url) as c:
        windowed = c.score([long_text, short], long_text="windows")
        truncated = c.score([long_text, short])
    assert_detoxify_scores(tiny_detoxify, [long_text, short], scores(truncated))
    local = Scorer(TorchBackend(tiny_detoxify, MODEL), 1024, 16).score([long_text, short], "windows")[0]
    for got, want in zip(scores(windowed), local, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert max(abs(windowed[0][k] - truncated[0][k]) for k in truncated[0].scores) > 1e-3
    assert windowed[1].scores == pytest.approx(truncated[1].scores, abs=1e-4)


def test_fully_cached_job_succeeds_without_a_worker(fleet: Fleet, tiny_detoxify: Any) -> None:
    """Texts scored once are cached: resubmitted while the worker is frozen (SIGSTOP), the job succeeds
    at once with every text a cache hit, and reads exactly like a job a worker scored. A partly cached
    job waits for the worker, which scores only the rest."""
    texts = CommentCorpus(34).texts(20)
    api_metrics = fleet.api_metrics
    answered_before = metric(api_metrics, "toxfleet_cache_answered_texts_total")
    hits_before = metric(fleet.worker_metrics, "toxfleet_cache_hits_total")
    with Client(fleet.url) as c:
        first = c.submit(texts).wait(timeout=30)
        assert first.cache_hits == 0
        worker = fleet.worker.proc
        assert worker is not None
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            job = c.submit(texts)
            t0 = time.monotonic()
            again = job.wait(timeout=5)
            assert time.monotonic() - t0 < 2
            assert again.status == "succeeded" and again.cache_hits == len(texts) and again.model == MODEL
            assert again.results == first.results
            import httpx

            body = httpx.get(f"{fleet.url}/v1/jobs/{job.id}").json()
            assert set(body) == {"id", "status", "results", "model", "error", "progress", "flags", "cache_hits",
                                 "created_at", "started_at", "finished_at", "expires_at"}
            assert body["progress"] == {"done": 20, "total": 20}
            assert body["created_at"] <= body["started_at"] <= body["finished_at"] < body["expires_at"]
            # Answered from the cache at once: the 202 already says so.
            accepted = httpx.post(f"{fleet.url}/v1/jobs", json={"texts": texts}, timeout=5)
            assert accepted.status_code == 202 and accepted.json()["status"] == "succeeded"
            partly = c.submit([*texts[:5], "never seen before, not cached"])
            assert partly.status().status == "queued"
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        done = partly.wait(timeout=30)
        assert done.cache_hits == 5
        assert_detoxify_scores(tiny_detoxify, [*texts[:5], "never seen before, not cached"], scores(done.results or []))
    stats = score_cache.ScoreCache(fleet.redis.client()).stats()
    assert stats["hits"] >= 25 and stats["entries"] >= 21
    # The same hits in the metrics: the API's for the job it answered alone, the worker's for the rest.
    assert metric(api_metrics, "toxfleet_cache_answered_texts_total") - answered_before == 40  # two cached jobs
    assert metric(api_metrics, "toxfleet_cache_entries") >= 21
    wait_for(lambda: metric(fleet.worker_metrics, "toxfleet_cache_hits_total") - hits_before == 5, 10,
             "worker cache-hit counter")


def test_cache_never_answers_for_another_backend(fleet: Fleet, tiny_detoxify: Any) -> None:
    """An entry planted under another backend's key is never returned; one planted under the fleet's
    own key is (which proves the lookup really uses model identity + backend + mode)."""
    cache = score_cache.ScoreCache(fleet.redis.client())
    planted = dict.fromkeys(tiny_detoxify.class_names, 0.123)
    cache.put(score_cache.namespace(MODEL, "onnx", "truncate"), ["planted elsewhere"], [planted])
    cache.put(score_cache.namespace(MODEL, "torch", "truncate"), ["planted here"], [planted])
    with Client(fleet.url) as c:
        elsewhere, here = c.score(["planted elsewhere"]), c.score(["planted here"])
    assert_detoxify_scores(tiny_detoxify, ["planted elsewhere"], scores(elsewhere))
    assert here[0].scores == planted


def run_cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TOXFLEET, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "kill-9"])
def test_cli_resumes_after_interrupt(fleet: Fleet, tiny_detoxify: Any, tmp_path: Path, signum: int) -> None:
    """`toxfleet score` interrupted mid-run: by SIGINT it exits 130 with whole rows written; killed -9
    (OOM killer, a closed laptop) it may leave a torn last row. Re-run, it cuts any torn row, skips the
    whole ones, and every input row is in the output exactly once, in order, with Detoxify's scores."""
    texts = CommentCorpus(35).texts(300)
    src, out = tmp_path / "comments.jsonl", tmp_path / "scored.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    env = base_env(fleet.redis.url, None)
    args = ["score", str(src), "-o", str(out), "--url", fleet.url, "--job-size", "3", "--in-flight", "2"]
    proc = subprocess.Popen([TOXFLEET, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rows_written() -> int:
        return out.read_text().count("\n") if out.exists() else 0

    wait_for(lambda: rows_written() >= 30, 60, "the CLI to write 30 rows", interval=0.01)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    partial = rows_written()
    assert 30 <= partial < len(texts)
    if signum == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "interrupted" in err
        assert out.read_text().endswith("\n")
    else:
        assert proc.returncode == -signal.SIGKILL

    done = run_cli(args, env)
    assert done.returncode == 0, done.stderr
    assert f"resuming: {partial} of 300" in done.stderr and "rows/s" in done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(texts)))
    labels = list(tiny_detoxify.class_names)
    assert_detoxify_scores(tiny_detoxify, texts, [{k: r[k] for k in labels} for r in rows])
    assert all(r["flagged"] == any(r[k] >= 0.5 for k in labels) for r in rows)


def test_cli_csv_reports_failed_rows(fleet: Fleet, tiny_detoxify: Any, tmp_path: Path) -> None:
    """CSV in and out with a chosen column: a row the API refuses (too long) is written with an
    `error` and counted (exit 3), never dropped; the rows around it are scored."""
    src, out = tmp_path / "in.csv", tmp_path / "out.csv"
    bodies = ["first comment", "x" * 25_000, "", "line one\nline two, with a comma"]
    with open(src, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body"])
        writer.writerows([[i, b] for i, b in enumerate(bodies)])
    done = run_cli(["score", str(src), "-o", str(out), "--field", "body", "--url", fleet.url,
                    "--prefix", "tox_", "--no-progress"], base_env(fleet.redis.url, None))
    assert done.returncode == 3, done.stderr
    assert "1 rows failed" in done.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == ["0", "1", "2", "3"]
    assert rows[1]["error"] and rows[1]["tox_toxicity"] == ""
    good = [r for i, r in enumerate(rows) if i != 1]
    assert all(r["error"] == "" and r["flagged"] in ("True", "False") for r in good)
    assert_detoxify_scores(tiny_detoxify, [r["body"] for r in good],
                  [{k: float(r["tox_" + k]) for k in tiny_detoxify.class_names} for r in good])


def test_cli_local_mode_needs_no_fleet(tiny_checkpoint: tuple[Path, Path], tiny_detoxify: Any, tmp_path: Path) -> None:
    """--local scores in-process (no Redis, no API) with the same scores and flags."""
    texts = CommentCorpus(36).texts(10)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    env = base_env("redis://127.0.0.1:1/0", tiny_checkpoint)
    done = run_cli(["score", str(src), "-o", str(out), "--local", "--threads", "1", "--threshold", "0.3"], env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    labels = list(tiny_detoxify.class_names)
    assert_detoxify_scores(tiny_detoxify, texts, [{k: r[k] for k in labels} for r in rows])
    assert all(r["flagged"] == any(r[k] >= 0.3 for k in labels) for r in rows)


def test_cli_says_so_when_no_api_answers(tmp_path: Path) -> None:
    """A wrong --url fails at once with a message naming it (not after the retry budget)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n')
    t0 = time.monotonic()
    done = run_cli(["score", str(src), "--url", "http://127.0.0.1:1"], base_env("redis://127.0.0.1:1/0", None))
    assert done.returncode == 1 and "cannot reach the toxfleet API at http://127.0.0.1:1" in done.stderr
    assert time.monotonic() - t0 < 30
