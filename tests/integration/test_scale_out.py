"""Bounded prefetch: a worker started while another is saturated gets a fair share of the backlog at
once, instead of finding it all prefetched (held unacked) by the busy worker."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet.corpus import CommentCorpus
from testing import RedisServer, free_port, start_api, start_worker, wait_for

MESSAGES = 96
"""Backlog, in messages (one long text each): fewer than the old prefetch (64 per process x 2) held,
more than the bounded one (16 x 2)."""


def scored(metrics_url: str) -> float:
    families = text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text)
    return sum(s.value for f in families for s in f.samples
               if s.name == "toxfleet_tasks_total" and s.labels.get("outcome") == "succeeded")


def test_a_worker_started_under_backlog_scores_a_fair_share(redis_server: RedisServer,
                                                            tiny_checkpoint: tuple[Path, Path],
                                                            session_tmp: Path) -> None:
    redis_url = redis_server.flush(9)
    ports = [free_port(), free_port()]
    env = {"TOXFLEET_CACHE": "false"}
    first = start_worker(session_tmp, redis_url, tiny_checkpoint, name="scale1",
                         env={**env, "TOXFLEET_METRICS_PORT": str(ports[0])})
    procs = [first]
    try:
        api, url = start_api(session_tmp, redis_url, name="scale-api", TOXFLEET_CACHE="false",
                             TOXFLEET_BACKLOG_PER_PROCESS="10000")
        procs.append(api)
        corpus = CommentCorpus(13)
        # Long texts scored as windows: each message costs many forward passes, so the backlog lasts.
        texts = [" ".join(corpus.texts(60))[:20_000] for _ in range(MESSAGES)]
        with httpx.Client(base_url=url, timeout=60) as c:
            jobs = [c.post("/v1/jobs", json={"texts": texts[i:i + 8], "long_text": "windows"}).json()["id"]
                    for i in range(0, MESSAGES, 8)]
            second = start_worker(session_tmp, redis_url, tiny_checkpoint, name="scale2",
                                  env={**env, "TOXFLEET_METRICS_PORT": str(ports[1])})
            procs.append(second)
            metrics = [f"http://127.0.0.1:{p}/metrics" for p in ports]
            wait_for(lambda: all(httpx.get(m, timeout=1).status_code == 200 for m in metrics), 20, "metrics")
            # The second serves its metrics once it consumes (worker_ready): what is left then is the
            # backlog it can share. How much that is depends on how fast the first scores meanwhile.
            left = MESSAGES - scored(metrics[0])
            for job in jobs:
                assert c.get(f"/v1/jobs/{job}", params={"wait": 30}).json()["status"] == "succeeded"
        by_first, by_second = scored(metrics[0]), scored(metrics[1])
        print(f"first worker scored {by_first:.0f} messages, the one started under backlog {by_second:.0f} "
              f"of the {left:.0f} left when it was ready")
        assert by_first + by_second == MESSAGES
        assert left > 0, "the backlog drained before the second worker was ready: nothing was shared"
        # With the old prefetch (64 per process) the first worker held the whole backlog and the second
        # scored none (TOXFLEET_PREFETCH_MULTIPLIER=64 on a Zen 5: 96 and 0, nothing left at its start).
        assert by_second >= left / 4
    finally:
        for proc in reversed(procs):
            proc.stop()
