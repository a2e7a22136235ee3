"""Hostile but well-formed input through the real API, a real worker and the tiny checkpoint, API keys on.

Issue 14's list: NUL, lone surrogates, right-to-left marks, emoji ZWJ sequences, one 100 KB token and
10,000 one-character texts. Each text gets a clear 4xx (a problem naming the field) or exactly the
score Detoxify itself gives it; never a 5xx, a hang or a job left unfinished. Every route that takes
texts is tried: `POST /v1/jobs`, `GET /toxicity`, `POST /toxicity/batch` and the Python client.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from celery import Celery

from testing import Fleet, FleetSpec, wait_for
from testing.scoring import assert_detoxify_scores
from toxfleet import contract
from toxfleet.client import Client

KEY = "bad-input-test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
FLEET = FleetSpec("badinput", db=10, worker_env={"TOXFLEET_CACHE": "false"},
                  api_env={"TOXFLEET_CACHE": "false", "TOXFLEET_API_KEYS": KEY,
                           "TOXFLEET_BACKLOG_PER_PROCESS": "100000"})

# Valid Unicode that tokenizers treat unusually: each must score as Detoxify scores it.
ODD_BUT_VALID = {
    "nul": "before\x00after",
    "only-nul": "\x00\x00\x00",
    "rtl-marks": "\u200fשלום\u200f you \u202eidiot\u202c",
    "emoji-zwj": "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and "
                 "\U0001F3F3\ufe0f\u200d\U0001F308",
    "combining": "Z\u0351\u0362a\u0308\u0301l\u0334g\u0336o\u0335",
    "bom-and-controls": "\ufeff\x07\x1b[31mred\x1b[0m\r\n\t",
    "private-use": "\ue000\U000f0000 text",
    "long-token-under-limit": "a" * (contract.MAX_TEXT_CHARS - 1),
}

# Not valid Unicode: JSON can carry a lone surrogate (`"\ud800"`), UTF-8 and the tokenizer cannot.
LONE_SURROGATES = ['"\\ud800"', '"x\\udfff y"', '"\\udc00\\ud800"']


def _job(c: httpx.Client, texts: list[str]) -> dict[str, Any]:
    r = c.post("/v1/jobs", json={"texts": texts})
    assert r.status_code == 202, r.text
    body: dict[str, Any] = c.get(r.headers["location"], params={"wait": 30}).json()
    assert body["status"] == "succeeded", body
    return body


def _raw_get_status(http: httpx.Client, target: str) -> int:
    url = http.base_url
    with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Connection: close\r\n\r\n".encode())
        status_line = sock.makefile("rb").readline().decode()
    assert status_line.startswith("HTTP/1.1 "), status_line
    return int(status_line.split()[1])


@pytest.fixture()
def http(fleet: Fleet) -> Any:
    with httpx.Client(base_url=fleet.url, timeout=60, headers=AUTH) as c:
        yield c


def test_odd_but_valid_texts_score_as_detoxify_does(http: httpx.Client, tiny_detoxify: Any) -> None:
    texts = list(ODD_BUT_VALID.values())
    body = _job(http, texts)
    assert_detoxify_scores(tiny_detoxify, texts, body["results"])
    # The drop-in routes ride the same queue and answer the same scores.
    batch = http.post("/toxicity/batch", json=texts)
    assert batch.status_code == 200, batch.text
    assert_detoxify_scores(tiny_detoxify, texts, batch.json())
    for name in ("nul", "rtl-marks", "emoji-zwj"):
        one = http.get("/toxicity", params={"q": ODD_BUT_VALID[name]})
        assert one.status_code == 200, (name, one.text)
        assert_detoxify_scores(tiny_detoxify, [ODD_BUT_VALID[name]], [one.json()])


@pytest.mark.parametrize("raw", LONE_SURROGATES)
def test_lone_surrogates_are_a_clear_422(http: httpx.Client, raw: str) -> None:
    for path, body in (("/v1/jobs", f'{{"texts": [{raw}]}}'), ("/toxicity/batch", f"[{raw}]")):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text)
        problem = r.json()
        assert problem["type"] == "/problems/validation"
        assert any("surrogate" in e["msg"] for e in problem["errors"]), problem
        assert "\\ud" not in r.text.lower() and "\ud800" not in r.text  # the input is not echoed


def test_a_100_kb_token_is_a_clear_413_or_422(http: httpx.Client) -> None:
    token = "x" * 100_000
    for path, payload in (("/v1/jobs", {"texts": [token]}), ("/toxicity/batch", [token])):
        r = http.post(path, json=payload)
        assert r.status_code in (413, 422), (path, r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json")
        assert str(contract.MAX_TEXT_CHARS) in r.text or r.status_code == 413
    # httpx refuses to send a 100 KB query string, so this one goes over a plain socket.
    assert 400 <= _raw_get_status(http, f"/toxicity?q={token}") < 500


def test_ten_thousand_one_character_texts(fleet: Fleet, http: httpx.Client, tiny_detoxify: Any) -> None:
    """One job of 10,000 is over the per-job limit (a 422 naming it); the client splits them into
    jobs within it and gets every score back, in order, equal to Detoxify's."""
    texts = [chr(ord("a") + i % 26) if i % 7 else "!" for i in range(10_000)]
    r = http.post("/v1/jobs", content=json.dumps({"texts": texts}), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.status_code
    assert str(contract.MAX_TEXTS_PER_JOB) in r.text
    with Client(fleet.url, api_key=KEY) as client:
        results = client.score(texts)
    assert_detoxify_scores(tiny_detoxify, texts, results)


def test_direct_celery_call_with_a_lone_surrogate_fails_clearly(fleet: Fleet, tiny_detoxify: Any) -> None:
    """`send_task` skips the API's checks: the worker fails that request with the reason (no hang),
    and a valid request sent beside it still scores."""
    # Apps of its own (a broker-only sender, a backend-only reader, as test_e2e does): the shared
    # `worker.app` keeps its first broker connection, which other modules' tests point elsewhere.
    sender = Celery(broker=fleet.redis_url)
    sender.conf.update(task_serializer="json", accept_content=["json"])
    reader = Celery(backend=fleet.redis_url)
    reader.conf.update(result_serializer="json", accept_content=["json"])
    bad = sender.send_task(contract.SCORE_TASK, args=[["fine", "x\ud800y"]], queue=contract.QUEUE).id
    good = sender.send_task(contract.SCORE_TASK, args=[[ODD_BUT_VALID["emoji-zwj"]]], queue=contract.QUEUE).id
    final = ("SUCCESS", "FAILURE")
    wait_for(lambda: all(reader.backend.get_task_meta(t)["status"] in final for t in (bad, good)), 60,
             "both direct calls to finish")
    failed = reader.backend.get_task_meta(bad)
    assert failed["status"] == "FAILURE" and "not valid Unicode" in str(failed["result"]), failed
    scored = reader.backend.get_task_meta(good)
    assert scored["status"] == "SUCCESS", scored
    assert_detoxify_scores(tiny_detoxify, [ODD_BUT_VALID["emoji-zwj"]], scored["result"])
