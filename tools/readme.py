"""Rewrite the generated blocks of README.md from what owns what they show (code, or another doc).

A block sits between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->`, and
`BLOCKS[NAME]` renders its body, so that a table never has to be retyped by hand. `python -m
tools.readme` rewrites README.md; `--check` only says which blocks are stale (exit status 1), as the
test suite does. A new block is one function added to `BLOCKS`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from api.settings import ApiSettings
from fleet.settings import SharedSettings
from worker.backends import registry
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARK_NOTES = ROOT / "docs" / "benchmarks" / "notes.md"
"""The hand-written part of docs/benchmarks.md, which owns the current results table."""

_BLOCK = re.compile(r"(?P<begin><!-- BEGIN generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"(?P<end><!-- END generated:(?P=name) -->)", re.DOTALL)


def variable(name: str, field: FieldInfo) -> str:
    """The environment variable a settings field reads: its first alias, else `TOXFLEET_<NAME>`."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"TOXFLEET_{name.upper()}"


def default_cell(field: FieldInfo) -> str:
    """A field's default as it would be written in the environment; `–` where there is none (the
    description then says what happens)."""
    if field.default_factory is not None:
        default: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        default = field.default
    if default is None or default is PydanticUndefined or (isinstance(default, SecretStr)
                                                            and not default.get_secret_value()):
        return "–"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    if isinstance(default, dict | list):
        return f"`{json.dumps(default)}`"
    if isinstance(default, str):
        return f"`{default}`"
    return str(default)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_table(tiers: Mapping[str, type[BaseSettings]]) -> str:
    """One Markdown row per field of each settings class, a field inherited from an earlier one listed
    once, under the first tier that declares it."""
    rows = ["| Variable | Default | Tier | Meaning |", "|---|---|---|---|"]
    seen: set[str] = set()
    for tier, cls in tiers.items():
        for name, field in cls.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            rows.append(f"| `{variable(name, field)}` | {default_cell(field)} | {tier} | "
                        f"{_cell(field.description or '')} |")
    return "\n".join(rows) + "\n"


def config() -> str:
    """The configuration table: the shared fields, then the API's, then the workers'."""
    return settings_table({"both": SharedSettings, "api": ApiSettings, "worker": WorkerSettings})


def benchmarks() -> str:
    """The current results table of docs/benchmarks.md (the first table under `## Current results`),
    without its last column (the links into docs/history.md)."""
    section = BENCHMARK_NOTES.read_text().split("## Current results\n", 1)[1]
    rows: list[str] = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append("|".join(line.split("|")[:-2]) + "|")
        elif rows:
            break
    if not rows:
        raise ValueError(f"{BENCHMARK_NOTES}: no table under '## Current results'")
    return "\n".join(rows) + "\n"


def backends() -> str:
    """The backend table, from `worker.backends.registry` (which imports no torch)."""
    return registry.markdown_table().rstrip("\n") + "\n"


BLOCKS: dict[str, Callable[[], str]] = {"config": config, "benchmarks": benchmarks, "backends": backends}
"""Block name -> what renders its body."""


def render(text: str, blocks: Mapping[str, Callable[[], str]] = BLOCKS) -> str:
    """`text` with every generated block's body rendered afresh; an unknown block name is an error."""
    def one(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in blocks:
            raise KeyError(f"no renderer for generated block {name!r} (known: {', '.join(blocks)})")
        return m["begin"] + blocks[name]() + m["end"]

    return _BLOCK.sub(one, text)


def stale(text: str, blocks: Mapping[str, Callable[[], str]] = BLOCKS) -> list[str]:
    """Names of the blocks whose body differs from what would be rendered now."""
    return [m["name"] for m in _BLOCK.finditer(text) if m["body"] != blocks[m["name"]]()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.readme", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale blocks (exit status 1)")
    parser.add_argument("path", nargs="?", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.path.read_text()
    if args.check:
        names = stale(text)
        if names:
            print(f"{args.path}: stale generated blocks: {', '.join(names)} (run python -m tools.readme)",
                  file=sys.stderr)
        return 1 if names else 0
    args.path.write_text(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
