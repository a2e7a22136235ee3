"""Static checks of docker-compose.yml and docker-compose.offline.yml, and their Redis command line,
URL and health probe run on a real redis-server; the backlog publisher run as Compose runs it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from testing import ROOT
from tests.deploy.deployfiles import (
    API_FILE,
    BACKLOG_COMMAND,
    COMPOSE,
    IMAGES,
    INFERENCE_PACKAGES,
    OFFLINE,
    PYPROJECT,
    SERVICES,
    STOP_TIMEOUT_MAX,
    WORKER_FILE,
    check_policy_tracks,
    closure,
    compose_health_argv,
    container,
    docker_duration,
    environment,
    interpolate,
    load_compose,
    looks_like_setting,
    parse_healthcheck,
    required_variables,
)
from tools import synthetic
from worker.settings import WorkerSettings


def test_compose_services() -> None:
    """Compose runs exactly Redis, the API, the workers, Flower and the backlog publisher."""
    assert set(SERVICES) == {"redis", "api", "worker", "flower", "backlog"}


@pytest.mark.parametrize(("files", "service"), [(("docker-compose.yml",), "worker"),
                                               (("docker-compose.yml", "docker-compose.offline.yml"), "worker"),
                                               (("docker-compose.yml", "docker-compose.offline.yml"), "synth")])
def test_compose_builds_the_worker_with_the_dockerfile_defaults(files: tuple[str, ...], service: str) -> None:
    """Unset, Compose's TOXFLEET_MODEL/TOXFLEET_BACKEND build args are Dockerfile.worker's defaults
    (`auto` included), so `docker compose build` and `docker build` make the same image."""
    args = load_compose(*files)["services"][service]["build"]["args"]
    for name in ("TOXFLEET_MODEL", "TOXFLEET_BACKEND"):
        assert interpolate(args[name], {}) == WORKER_FILE.global_args[name]
        assert interpolate(args[name], {name: "torch"}) == "torch"


@pytest.mark.parametrize("name", ["redis", "api", "worker", "flower"])
def test_compose_services_have_healthchecks(name: str) -> None:
    """Every service has a health check, so `service_healthy` orderings mean something."""
    check = SERVICES[name]["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL") and not check.get("disable")
    assert docker_duration(check["timeout"]) < docker_duration(check["interval"])


@pytest.mark.parametrize("name", ["api", "worker", "flower", "backlog"])
def test_services_start_after_redis_is_healthy(name: str) -> None:
    """The API, workers, Flower and the backlog publisher wait for a healthy Redis."""
    assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", ["api", "worker", "flower"])
def test_compose_health_checks_match_the_images_and_ecs(name: str) -> None:
    """Compose, the image's HEALTHCHECK and the ECS task run the same probe command."""
    dockerfile, stage = IMAGES[name]
    image_argv = parse_healthcheck(dockerfile.last(stage, "HEALTHCHECK")).argv  # type: ignore[arg-type]
    compose_argv = [interpolate(a, {}) for a in compose_health_argv(SERVICES[name]["healthcheck"]["test"])]
    ecs_argv = compose_health_argv(container(name)["healthCheck"]["command"])
    assert compose_argv == image_argv == ecs_argv


def _redis_options() -> dict[str, str]:
    command = SERVICES["redis"]["command"]
    assert command[0] == "redis-server"
    pairs = command[2:]  # command[1]: the config file with the password
    return {pairs[i].removeprefix("--"): str(pairs[i + 1]) for i in range(0, len(pairs), 2)}


def _redis_config() -> tuple[str, str]:
    """(where the redis container reads its password file, that file's content as written in Compose)."""
    (mount,) = SERVICES["redis"]["configs"]
    return mount["target"], COMPOSE["configs"][mount["source"]]["content"]


def test_redis_is_a_durable_authenticated_broker() -> None:
    """Redis 7: password required from a mandatory variable, AOF every second, no eviction, no port."""
    redis_service = SERVICES["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-[\w.]+)?", redis_service["image"])
    options = _redis_options()
    target, content = _redis_config()
    assert redis_service["command"][1] == target  # redis-server's config file argument
    assert content.splitlines() == ["requirepass ${REDIS_PASSWORD:?set REDIS_PASSWORD}"]
    assert options["appendonly"] == "yes" and options["appendfsync"] == "everysec"
    assert options["maxmemory-policy"] == "noeviction"
    assert "ports" not in redis_service
    assert any(v.endswith(":/data") for v in redis_service["volumes"])


def test_redis_password_is_not_in_what_docker_inspect_shows() -> None:
    """The redis container's command, environment and health check name no password: `docker inspect`
    shows those; the password is only in the mounted config file, which the probe reads."""
    redis_service = SERVICES["redis"]
    shown = [*map(str, redis_service["command"]), *environment(redis_service).values(),
             *redis_service["healthcheck"]["test"]]
    assert not any("REDIS_PASSWORD" in word for word in shown), shown
    assert "requirepass" not in " ".join(map(str, redis_service["command"]))
    target, _ = _redis_config()
    assert target in redis_service["healthcheck"]["test"][1]


@pytest.mark.parametrize("name", ["api", "worker", "flower", "backlog"])
def test_redis_url_carries_the_password(name: str) -> None:
    """Each client's REDIS_URL is redis://:<REDIS_PASSWORD>@redis:6379/0 and cannot be empty."""
    url = environment(SERVICES[name])["REDIS_URL"]
    assert required_variables(url) == {"REDIS_PASSWORD"}
    assert interpolate(url, {"REDIS_PASSWORD": "s3cret"}) == "redis://:s3cret@redis:6379/0"


def test_worker_is_scalable() -> None:
    """`--scale worker=N` works: no fixed name, hostname or host port on the worker."""
    worker = SERVICES["worker"]
    assert not {"container_name", "hostname", "ports"} & set(worker)


def test_worker_grace_period_matches_fargate() -> None:
    """The worker gets as long to finish its batches on `docker stop` as on Fargate (120 s)."""
    grace = docker_duration(SERVICES["worker"]["stop_grace_period"])
    assert grace == container("worker")["stopTimeout"] == STOP_TIMEOUT_MAX


def test_flower_requires_a_login_and_stays_on_loopback() -> None:
    """Flower refuses to start without FLOWER_BASIC_AUTH and is published on 127.0.0.1 only."""
    flower = SERVICES["flower"]
    assert required_variables(environment(flower)["FLOWER_BASIC_AUTH"]) == {"FLOWER_BASIC_AUTH"}
    assert flower["ports"] and all(str(p).startswith("127.0.0.1:") for p in flower["ports"])


def test_api_publishes_port_8000() -> None:
    """The API's container port 8000 is published (on loopback unless API_BIND says otherwise)."""
    (port,) = SERVICES["api"]["ports"]
    assert interpolate(port, {}) == "127.0.0.1:8000:8000"
    assert interpolate(port, {"API_BIND": "0.0.0.0"}) == "0.0.0.0:8000:8000"


def test_offline_override_builds_the_checkpoint_where_workers_read_it() -> None:
    """The offline override: a one-shot synth service writes a synthetic checkpoint into a volume
    that workers mount at the same absolute path (the checkpoint records it), and workers wait for it."""
    services = OFFLINE["services"]
    synth, worker = services["synth"], services["worker"]
    assert synth["command"][:2] == ["sh", "-c"]
    model = WORKER_FILE.global_args["TOXFLEET_MODEL"]
    for chosen in ({}, {"TOXFLEET_MODEL": "original-small"}):  # the checkpoint follows TOXFLEET_MODEL
        words = shlex.split(interpolate(synth["command"][-1], chosen))
        start = words.index("tools.synthetic")
        assert words[start + 1] == chosen.get("TOXFLEET_MODEL", model)
        checkpoint = interpolate(environment(worker)["TOXFLEET_CHECKPOINT"], chosen)
        assert checkpoint == f"{words[words.index('--out') + 1]}/{words[start + 1]}/model.ckpt"
        assert interpolate(synth["build"]["args"]["TOXFLEET_MODEL"], chosen) == words[start + 1]
    words = shlex.split(interpolate(synth["command"][-1], {}))
    start = words.index("tools.synthetic")
    kind, out = words[start + 1], words[words.index("--out") + 1]
    assert kind in synthetic.KINDS
    env = {k: interpolate(v, {}) for k, v in environment(worker).items() if k.startswith("TOXFLEET_")}
    # tools/synthetic.py writes <out>/<kind>/model.ckpt and <out>/<kind>/hf
    assert env["TOXFLEET_CHECKPOINT"] == f"{out}/{kind}/model.ckpt"
    assert env["TOXFLEET_HF_CONFIG"] == f"{out}/{kind}/hf"
    assert words[:3] == ["test", "-f", env["TOXFLEET_CHECKPOINT"]]
    assert f"models:{out}" in synth["volumes"] and f"models:{out}:ro" in worker["volumes"]
    assert worker["depends_on"]["synth"]["condition"] == "service_completed_successfully"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"  # the base file's, kept
    for service in (synth, worker):
        assert service["build"]["args"]["PREFETCH_MODEL"] == "0"
        assert service["build"]["dockerfile"] == "Dockerfile.worker"
    assert synth["healthcheck"]["disable"] is True and synth["restart"] == "no"


def test_compose_redis_command_runs_on_redis(compose_redis: tuple[int, str]) -> None:
    """redis-server accepts Compose's options and then refuses clients without the password."""
    port, password = compose_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()  # no retries: redis-py backs off ~3 s
    client = redis.Redis(port=port, password=password, decode_responses=True)
    config = {k: v for key in ("appendonly", "appendfsync", "maxmemory-policy")
              for k, v in client.config_get(key).items()}
    assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}


def test_compose_redis_url_and_healthcheck_work(compose_redis: tuple[int, str], tmp_path: Path) -> None:
    """Compose's REDIS_URL reaches and authenticates to that Redis, its health probe passes reading the
    password from the config file and fails with a file holding another, and WorkerSettings accepts the URL."""
    port, password = compose_redis
    url = interpolate(environment(SERVICES["worker"])["REDIS_URL"], {"REDIS_PASSWORD": password})
    assert redis.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}")).ping()
    assert WorkerSettings(REDIS_URL=url).redis_url == url  # type: ignore[call-arg]
    (kind, probe) = SERVICES["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "redis-cli ping" in probe
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed here (the redis image runs this probe); the URL was checked")
    target, content = _redis_config()
    wrong = tmp_path / "wrong.conf"
    wrong.write_text(interpolate(content, {"REDIS_PASSWORD": "nope"}))
    path = os.environ.get("PATH", "/usr/bin:/bin")

    def run(config: Path) -> subprocess.CompletedProcess[bytes]:
        script = interpolate(probe, {}).replace(target, str(config)).replace("redis-cli ", f"{cli} -p {port} ", 1)
        return subprocess.run(["sh", "-c", script], env={"PATH": path}, timeout=10, capture_output=True)

    assert run(tmp_path / "auth.conf").returncode == 0
    assert run(wrong).returncode != 0


def test_backlog_service_runs_the_publisher_once() -> None:
    """Compose's `backlog` service runs `python -m tools.backlog --interval 60` from the Flower image
    (same build), once: no port, no scaling, no inherited Flower probe, restarted if it dies."""
    service, flower = SERVICES["backlog"], SERVICES["flower"]
    assert service["command"] == BACKLOG_COMMAND
    assert service["build"] == flower["build"] and service["image"] == flower["image"]
    assert not {"ports", "expose", "scale", "deploy", "container_name"} & set(service)
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["healthcheck"]["disable"] is True  # the image's HEALTHCHECK probes Flower's port
    assert service["restart"] == "unless-stopped" and service["init"] is True
    running = [name for name, each in OFFLINE["services"].items()
               if "tools.backlog" in " ".join(map(str, each.get("command", [])))]
    assert running == ["backlog"]


FLOWER_IMAGE_ONLY = """\
import importlib.abc, importlib.metadata as md, runpy, sys
allowed, log = set(sys.argv[1].split(",")), open(sys.argv[2], "w")
owners = md.packages_distributions()

class FlowerImageOnly(importlib.abc.MetaPathFinder):
    # First on sys.meta_path: sees every module imported from here on; refuses installed packages
    # that the Flower image does not have, as if they were absent.
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        log.write(name + "\\n"); log.flush()
        dists = {d.lower().replace("_", "-") for d in owners.get(top, [])}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} in the Flower image", name=name)
        return None

sys.meta_path.insert(0, FlowerImageOnly())
module, sys.argv = sys.argv[3], sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
"""`python -m <module> args` with only the Flower image's distributions importable, logging each import."""


def test_backlog_publisher_runs_from_the_flower_image(compose_redis: tuple[int, str], tmp_path: Path) -> None:
    """The deployed command, run against Compose's Redis with its REDIS_URL and the Flower image's
    environment, with only the Flower image's packages importable (base dependencies and the flower
    extra), prints an EMF line the scaling policy reads at once, and imports no torch, detoxify,
    transformers or Celery on the way."""
    port, password = compose_redis
    command = SERVICES["backlog"]["command"]
    assert command[:3] == ["python", "-m", "tools.backlog"]
    project = PYPROJECT["project"]
    image = closure(project["dependencies"] + project["optional-dependencies"]["flower"], set()) | {"toxfleet"}
    driver, imports = tmp_path / "flower_image_only.py", tmp_path / "imports"
    driver.write_text(FLOWER_IMAGE_ONLY)
    url = interpolate(environment(SERVICES["backlog"])["REDIS_URL"], {"REDIS_PASSWORD": password})
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOXFLEET_")}
    env.update({k: v for k, v in API_FILE.env(API_FILE.stage("flower")).items() if looks_like_setting(k)},
               REDIS_URL=url.replace("@redis:6379", f"@127.0.0.1:{port}"), PYTHONPATH=str(ROOT))
    argv = [sys.executable, str(driver), ",".join(sorted(image)), str(imports), command[2], *command[3:]]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # The first reading is immediate; a publisher that prints nothing must fail the test, not hang it.
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    assert line, stderr[-3000:]
    doc = json.loads(line)
    check_policy_tracks(doc)
    assert doc["Workers"] == 0 and doc["BacklogPerTask"] == 0
    imported = {name.split(".")[0] for name in imports.read_text().split()}
    assert {"redis", "toxfleet"} <= imported  # the log did see the imports
    assert not imported & {*INFERENCE_PACKAGES, "celery", "kombu"}, imported


COMPOSE_SPEC = Path(__file__).with_name("compose-spec.json")
"""The Compose Specification's JSON schema, schema/compose-spec.json of github.com/compose-spec/compose-spec
at 170098ba07d9 (2026-06-23), Apache-2.0: what `docker compose config` validates against."""


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.offline.yml"])
def test_compose_files_follow_the_compose_spec(name: str) -> None:
    """Each Compose file, as written and with its variables filled, is valid under the compose-spec
    schema (top-level `configs` with `content` included); a misspelt key fails it."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed (dev extra)")
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SPEC.read_text()))  # its $schema: draft-07
    data = yaml.safe_load((ROOT / name).read_text())
    validator.validate(data)
    filled = yaml.safe_load(interpolate((ROOT / name).read_text(), {"REDIS_PASSWORD": "x" * 32,
                                                                     "FLOWER_BASIC_AUTH": "admin:pw"}))
    validator.validate(filled)
    broken = json.loads(json.dumps(data))
    next(iter(broken["services"].values()))["healthchek"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)
