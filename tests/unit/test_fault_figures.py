"""The fault suite's counting (testing/faults.py), the workers' execution record it reads
(worker/executions.py) and the soak's memory verdict: pure logic, on records built here."""

from __future__ import annotations

from pathlib import Path

from bench.soak import memory_verdict
from testing.faults import ExecutionLog, ResultObserver, canonical_task, describe_change, measure
from worker import executions


def test_the_record_counts_a_request_claimed_by_two_batches(tmp_path: Path) -> None:
    path = tmp_path / "executions.jsonl"
    executions.record(path, "b1", ["job1.0", "job1.1"])
    executions.record(path, "b2", ["job1.1"])  # scored again (its first batch was killed)
    executions.record(path, "b3", [])  # claimed nothing: no line
    executions.record(None, "b4", ["job1.0"])  # off: no line
    with open(path, "a") as f:
        f.write('{"batch": "cut by a kill')  # a partial last line is skipped
    log = ExecutionLog(path)
    assert [e["batch"] for e in log.entries()] == ["b1", "b2"]
    assert log.rescored() == 1 and log.executions() == {"job1.0": 1, "job1.1": 2}


def test_a_resubmitted_job_counts_under_its_first_id(tmp_path: Path) -> None:
    path = tmp_path / "executions.jsonl"
    executions.record(path, "b1", ["old.0", "old.1"])
    executions.record(path, "b2", ["new.0", "new.1", "other.0"])  # resubmitted as "new" after a 404
    log = ExecutionLog(path)
    assert log.rescored() == 0
    assert log.rescored(canonical_task({"new": "old"})) == 2


def test_the_observer_flags_a_result_published_differently() -> None:
    observer = ResultObserver("redis://127.0.0.1:1/0")
    observer.seen({"task_id": "a.0", "status": "STARTED", "result": None})
    observer.seen({"task_id": "a.0", "status": "SUCCESS", "result": [1]})
    observer.seen({"task_id": "a.0", "status": "SUCCESS", "result": [1]})
    observer.seen({"task_id": "b.0", "status": "SUCCESS", "result": [1]})
    observer.seen({"task_id": "b.0", "status": "SUCCESS", "result": [2]})
    assert observer.finals == {"a.0": 2, "b.0": 2} and observer.changed == {"b.0"}


def test_lost_and_recovery_from_what_was_read() -> None:
    figures = measure("unit", accepted=["done-before", "hit", "slow", "never"],
                      final={"done-before": 5.0, "hit": 12.0, "slow": 30.0},
                      observed={"done-before": 4.0, "hit": 11.0, "slow": None},
                      rescored=1, changed=0, fault_at=10.0, affected=["hit", "never"])
    # "never" is lost; recovery ends at the last affected job's final status (observed 11.0); "slow"
    # was not hit by the fault; the observer missed "slow" (the read stands in, and it is reported).
    assert figures["lost"] == 1 and figures["affected"] == 2 and figures["recovery_s"] == 1.0
    assert figures["observer_missed"] == 1 and figures["jobs"] == 4


def test_memory_verdict_judges_the_slope_against_the_bound() -> None:
    rss = {"w0:1": {"mb_start": 400.0, "mb_per_min": 0.1, "minutes": 10.0},
           "w0:2": {"mb_start": 85.0, "mb_per_min": 0.2, "minutes": 10.0},
           "r3:9": {"mb_start": 400.0, "mb_per_min": 9.0, "minutes": 0.5}}
    verdict = memory_verdict(rss, bound_pct_per_hour=5.0, min_minutes=2.0)
    assert verdict["processes"]["w0:1"]["passed"]  # bound 0.333 MB/min
    assert not verdict["processes"]["w0:2"]["passed"]  # bound 0.071 MB/min
    assert verdict["not_judged"] == ["r3:9"] and not verdict["passed"]
    assert not memory_verdict({}, 5.0, 2.0)["passed"]  # nothing judged proves nothing


def test_a_change_says_whether_only_numbers_moved() -> None:
    assert describe_change(("SUCCESS", [{"toxicity": 0.5}]), ("SUCCESS", [{"toxicity": 0.5000001}])) \
        == "numbers only, max |diff| 1.00e-07"
    assert describe_change(("SUCCESS", [1.0]), ("FAILURE", "lost")).startswith('["SUCCESS"')
