"""Priority lanes on a real worker: interactive work overtakes a bulk backfill already queued."""

from __future__ import annotations

import time

import httpx
import redis

from fleet.corpus import CommentCorpus
from testing import Fleet, FleetSpec
from toxfleet import contract

# One pool process: the bulk job then takes long enough to still run when the interactive one is done.
FLEET = FleetSpec("lanes", db=8, worker_env={"TOXFLEET_CACHE": "false", "TOXFLEET_CONCURRENCY": "1"},
                  api_env={"TOXFLEET_CACHE": "false", "TOXFLEET_BACKLOG_PER_PROCESS": "1000"})


def test_interactive_job_overtakes_a_bulk_backlog(fleet: Fleet) -> None:
    queues = redis.Redis.from_url(fleet.redis_url)
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        # Long texts (hundreds of tokens each): 300 of them keep the worker busy for a while.
        corpus = CommentCorpus(5)
        bulk_texts = [" ".join(corpus.texts(12)) for _ in range(300)]
        bulk = c.post("/v1/jobs", json={"texts": bulk_texts, "priority": "bulk"}).json()["id"]
        assert queues.llen(contract.BULK_QUEUE) > 0 and queues.llen(contract.QUEUE) == 0
        t0 = time.monotonic()
        quick = c.post("/v1/jobs", json={"texts": ["an interactive one"]}).json()["id"]
        done = c.get(f"/v1/jobs/{quick}", params={"wait": 30}).json()
        elapsed = time.monotonic() - t0
        backfill = c.get(f"/v1/jobs/{bulk}").json()
        assert done["status"] == "succeeded"
        assert backfill["status"] != "succeeded", "the bulk job finished first: the test proves nothing"
        print(f"interactive job: {elapsed:.2f}s; bulk job then {backfill['progress']}")
        assert elapsed < 5
        # The rest of the backfill is not needed: deleted, the worker skips it (and stops promptly).
        assert c.delete(f"/v1/jobs/{bulk}").status_code == 204
