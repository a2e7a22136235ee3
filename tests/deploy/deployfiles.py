"""Readers for the deployment files, for the tests: Dockerfiles, Compose files, ECS JSON.

Small on purpose: each reads only what the tests check, and fails loudly on what it does not know,
rather than guess. Docker itself is not needed (there may be no engine where the tests run).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
