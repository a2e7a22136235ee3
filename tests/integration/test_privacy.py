"""No scored text leaves the request: a canary is scored through every route, by real processes (a
worker, the API under uvicorn with its access log on, Flower), then searched for in every log stream
and in Flower's task API."""

from __future__ import annotations

from typing import Any

import httpx
from celery import Celery

from testing import Fleet, FleetSpec, wait_for
from toxfleet import contract

CANARY = "canary-5e1f-do-not-log"
FLOWER_AUTH = ("tester", "s3cret-privacy")
# JSON logs on the API (its access lines carry the path as a field); Celery's own text on the worker.
FLEET = FleetSpec("priv", db=6, access_log=True, flower_auth=FLOWER_AUTH,
                  worker_env={"TOXFLEET_CACHE": "false"},
                  api_env={"TOXFLEET_LOG_FORMAT": "json", "TOXFLEET_CACHE": "false"})


def _flower_tasks(fleet: Fleet) -> dict[str, Any]:
    tasks: dict[str, Any] = httpx.get(fleet.flower + "/api/tasks", auth=FLOWER_AUTH, timeout=10).json()
    return tasks


def test_no_scored_text_in_logs_events_or_flower(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        job = c.post("/v1/jobs", json={"texts": [f"{CANARY} one", f"{CANARY} two"]}).json()
        assert c.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()["status"] == "succeeded"
        one = c.get("/toxicity", params={"q": f"{CANARY} three"})
        assert one.status_code == 200 and "toxicity" in one.json()
        many = c.post("/toxicity/batch", json=[f"{CANARY} four", f"{CANARY} five", f"{CANARY} six"])
        assert many.status_code == 200 and len(many.json()) == 3
    # A direct caller that sends no argsrepr: Celery would put the texts themselves in it.
    direct = Celery("direct", broker=fleet.redis_url, backend=fleet.redis_url, set_as_current=False)
    direct.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    result = direct.send_task(contract.SCORE_TASK, args=[[f"{CANARY} seven"]], queue=contract.QUEUE)
    assert len(result.get(timeout=30)) == 1
    del result  # its finalizer unsubscribes, which must happen while Redis is still up
    direct.close()

    # Flower heard every request (5 messages at most for these 4 submissions) before we look.
    wait_for(lambda: sum(t["state"] == "SUCCESS" for t in _flower_tasks(fleet).values()) >= 4, 30,
             "flower to list the scored tasks")
    tasks = _flower_tasks(fleet)
    assert CANARY not in str(tasks)
    assert {t["args"] for t in tasks.values()} <= {"1 texts", "2 texts", "3 texts"}, tasks
    for proc in fleet.procs:
        assert CANARY not in proc.output(), f"{proc.name} logged a scored text"
    access = fleet.api.output()
    assert '"path": "/toxicity?[redacted]"' in access  # the access log is on, and redacted
