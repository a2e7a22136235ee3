"""Process helpers the tests and the benchmark share: a private Redis, real worker/API/Flower processes.

Nothing here is a fixture (those live in tests/conftest.py); `bench` uses these too, and never imports
`tests`. Every process runs with this interpreter, from the repository root, so the virtual
environment that runs pytest or the benchmark is the one under test.
"""

from testing.checkpoints import MODELS, synthetic_checkpoint
from testing.processes import (
    ROOT,
    GaveUp,
    Proc,
    base_env,
    child_pids,
    free_port,
    reap_on_term,
    track,
    untrack,
    wait_for,
)
from testing.redis_server import RedisServer
from testing.services import Fleet, FleetSpec, api_metrics, start_api, start_fleet, start_flower, start_worker

__all__ = [
    "MODELS",
    "ROOT",
    "Fleet",
    "FleetSpec",
    "GaveUp",
    "Proc",
    "RedisServer",
    "api_metrics",
    "base_env",
    "child_pids",
    "free_port",
    "reap_on_term",
    "start_api",
    "start_fleet",
    "start_flower",
    "start_worker",
    "synthetic_checkpoint",
    "track",
    "untrack",
    "wait_for",
]
