"""Readers for the deployment files, for the tests: Dockerfiles, Compose files, ECS JSON, the CloudFormation
template; and what the test modules share (the files parsed once, the expectations several modules check).

Small on purpose: each reads only what the tests check, and fails loudly on what it does not know,
rather than guess. Docker itself is not needed (there may be no engine where the tests run).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from testing import ROOT

ECS_DIR = ROOT / "deploy" / "ecs"
TASK_DEFINITIONS = ("api", "worker", "flower")
SCALING_POLICIES = ("api-scaling", "worker-scaling")


# ---- Dockerfiles -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    args: str  # the rest, continuation lines joined
    line: int


@dataclass
class Stage:
    base: str  # FROM's image or stage name, ${ARG}s resolved with the global defaults
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.path.name}: no stage {name!r}")

    def lineage(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it is built FROM, root first."""
        chain = [stage]
        names = {s.name: s for s in self.stages if s.name}
        while chain[0].base in names:
            chain.insert(0, names[chain[0].base])
        return chain

    def effective(self, stage: Stage, keyword: str) -> list[Instruction]:
        """The instructions of one kind a stage has, its parents' included."""
        return [i for s in self.lineage(stage) for i in s.instructions if i.keyword == keyword]

    def last(self, stage: Stage, keyword: str) -> Instruction | None:
        found = self.effective(stage, keyword)
        return found[-1] if found else None

    def env(self, stage: Stage) -> dict[str, str]:
        """ENV values the stage's containers start with (unexpanded, as written)."""
        env: dict[str, str] = {}
        for instr in self.effective(stage, "ENV"):
            for pair in shlex.split(instr.args):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"{self.path.name}:{instr.line}: use ENV KEY=VALUE")
                env[key] = value
        return env

    def args(self, stage: Stage) -> dict[str, str | None]:
        """ARGs declared in the stage itself (only those reach its RUN steps), with defaults."""
        declared: dict[str, str | None] = {}
        for instr in stage.instructions:
            if instr.keyword == "ARG":
                name, sep, default = instr.args.strip().partition("=")
                declared[name] = default if sep else self.global_args.get(name)
        return declared


def parse_dockerfile(path: Path) -> Dockerfile:
    lines = path.read_text().splitlines()
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue  # comments (and parser directives) vanish, even inside a continuation
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        logical.append((start, buffer + stripped))
        buffer = ""
    if buffer:
        raise ValueError(f"{path.name}: file ends inside a line continuation")

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, rest = text.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--")]
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{path.name}:{number}: only ARG may precede the first FROM")
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, rest, number))
    return Dockerfile(path, global_args, stages)


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN line, split at `&&`, `||`, `;` and `|` (quotes respected)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        elif commands[-1] or token not in ("if", "then", "else", "elif", "fi", "do", "done", "!"):
            commands[-1].append(token)  # keywords that open a compound are not part of its commands
    return [c for c in commands if c]


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument list; anything else is an error, not a guess."""
    value = json.loads(args)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not an exec-form array: {args}")
    return value


@dataclass(frozen=True)
class Healthcheck:
    options: dict[str, str]
    argv: list[str]


def parse_healthcheck(instr: Instruction) -> Healthcheck:
    """`HEALTHCHECK [--opt=value ...] CMD [...]` in exec form."""
    options: dict[str, str] = {}
    rest = instr.args
    while rest.startswith("--"):
        option, _, rest = rest.partition(" ")
        key, _, value = option[2:].partition("=")
        options[key] = value
        rest = rest.strip()
    command, _, rest = rest.partition(" ")
    if command.upper() != "CMD":
        raise ValueError(f"HEALTHCHECK without CMD at line {instr.line}")
    return Healthcheck(options, exec_form(rest.strip()))


def docker_duration(text: str) -> float:
    """Seconds in a Docker/Compose duration such as `30s`, `2m`, `1m30s`."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


# ---- Compose ---------------------------------------------------------------------------------

def load_compose(*names: str) -> dict[str, Any]:
    """Compose files merged the way `docker compose -f a -f b` merges the parts used here:
    mappings merge key by key, lists of volumes/ports append, scalars and commands replace."""
    merged: dict[str, Any] = {}
    for name in names:
        data = yaml.safe_load((ROOT / name).read_text())
        merged = _merge(merged, data)
    return merged


def _merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list) and key in ("volumes", "ports"):
        return base + override
    return override


_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:\?|:-)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation for the forms used here: ${X}, ${X:-default}, ${X:?error}, $$."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2), match.group(3)
        value = env.get(name, "")
        if op == ":?" and not value:
            raise KeyError(f"required variable {name}: {arg}")
        if op == ":-" and not value:
            return arg
        return value

    return _VARIABLE.sub(one, text)


def required_variables(text: str) -> set[str]:
    """Variables a Compose string refuses to run without (`${X:?...}`)."""
    return {m.group(1) for m in _VARIABLE.finditer(text) if m.group(2) == ":?"}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # KEY=VALUE list form
        return dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_health_argv(test: list[str]) -> list[str]:
    """A Compose/ECS health `test` as the argv Docker runs (CMD-SHELL runs under /bin/sh -c)."""
    kind, *rest = test
    if kind == "CMD":
        return rest
    if kind == "CMD-SHELL":
        return ["sh", "-c", " ".join(rest)]
    raise ValueError(f"unknown health check form {kind!r}")


# ---- ECS -------------------------------------------------------------------------------------

def load_ecs(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ECS_DIR / f"{name}.json").read_text())
    return data


def container(task: str, name: str | None = None) -> dict[str, Any]:
    """One container of an ECS task definition: by default the task's own (named like the task)."""
    found: list[dict[str, Any]] = [c for c in load_ecs(task)["containerDefinitions"] if c["name"] == (name or task)]
    if len(found) != 1:
        raise KeyError(f"deploy/ecs/{task}.json: {len(found)} containers named {name or task!r}")
    return found[0]


def placeholders(text: str) -> set[str]:
    """`${NAME}` placeholders, as `envsubst` fills them."""
    return set(re.findall(r"\$\{(\w+)\}", text))


# ---- what the test modules share: the files read once, the services' expectations ---------------

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


SERVICES = COMPOSE["services"]


def closure(requirements: list[str], extras: set[str]) -> set[str]:
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


def check_policy_tracks(doc: dict[str, Any]) -> None:
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


def api_settings_classes() -> list[type[BaseSettings]]:
    module = importlib.import_module("api.settings")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, BaseSettings) and c is not BaseSettings]
    assert classes, "api/settings.py defines no pydantic-settings class"
    return classes


# ---- CloudFormation ------------------------------------------------------------------------------

TEMPLATE_PATH = ROOT / "deploy" / "cloudformation" / "toxfleet.yaml"


class _CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (`!Ref X`, `!Sub ...`, `!GetAtt A.B`) read as their long forms."""


def _cfn_tag(loader: _CfnLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _cfn_tag)


def load_template(text: str | None = None) -> dict[str, Any]:
    """The CloudFormation template as plain data (long-form intrinsic functions)."""
    data: dict[str, Any] = yaml.load(TEMPLATE_PATH.read_text() if text is None else text, Loader=_CfnLoader)  # noqa: S506
    return data
