"""The existing service, reproduced exactly, as the benchmark's baseline.

This is the design toxfleet replaces (the seed's `app/server.py`): one module-level Detoxify model,
loaded before Gunicorn forks (`--preload`), and a synchronous `GET /toxicity?q=` that calls
`model.predict([q])` for every request. Served as the seed serves it:

    OMP_NUM_THREADS=1 gunicorn bench.baseline_app:app -k uvicorn.workers.UvicornWorker \
        --workers <cores> --preload --keep-alive 30 --backlog 2048

The only change is where the weights come from: offline, a Detoxify-format checkpoint named by
TOXFLEET_CHECKPOINT and TOXFLEET_HF_CONFIG (the same files the toxfleet workers load), instead of
`Detoxify("unbiased-small")`, which downloads. Nothing here is tuned: it is the thing being measured.
"""

from __future__ import annotations

import os
from typing import Any

from detoxify import Detoxify
from fastapi import FastAPI, HTTPException

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = FastAPI()

model = Detoxify(checkpoint=os.environ["TOXFLEET_CHECKPOINT"],
                 huggingface_config_path=os.environ.get("TOXFLEET_HF_CONFIG"), device="cpu")


@app.get("/healthcheck")
def healthcheck() -> dict[str, str]:
    return {"status": "OK"}


@app.get("/healthcheck/loadbalancer")
def healthcheck_lb() -> dict[str, str]:
    return {"status": "OK"}


@app.get("/toxicity")
def predict(q: str) -> Any:
    try:
        return model.predict([q])
    except Exception as e:
        raise HTTPException(status_code=400, detail=str(e)) from e
