"""Read the deployment files the way their tools do, without a container engine.

`interpolate` follows the Compose Specification's interpolation rules (the subset this
repository uses is tested in test_interpolation.py); `dockerfile_instructions` splits a
Dockerfile into instructions the way the builder does (continuations, comments,
exec-form JSON arguments).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
STRIX_DOC = REPO / "docs" / "STRIX_HALO.md"
CLIENTS_DOC = REPO / "docs" / "CLIENTS.md"

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    rf"|(?P<bare>{_NAME})"
    rf"|\{{(?P<name>{_NAME})(?:(?P<op>:?[-?+])(?P<arg>[^}}]*))?\}})"
)


class InterpolationError(ValueError):
    """A required variable (`${VAR:?message}`) is missing, as `docker compose` reports."""


def read_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """KEY=VALUE lines of a compose `.env` file (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match["escaped"]:
        return "$"
    name = match["bare"] or match["name"]
    op, arg = match["op"], match["arg"] or ""
    value = env.get(name)
    unset_or_empty = not value
    missing = unset_or_empty if op and op.startswith(":") else value is None
    if op in (":-", "-"):
        return arg if missing else value  # type: ignore[return-value]
    if op in (":?", "?"):
        if missing:
            raise InterpolationError(f"required variable {name} is missing a value: {arg}")
        return value  # type: ignore[return-value]
    if op in (":+", "+"):
        return "" if missing else arg
    return value or ""  # unset without a default: compose warns and substitutes ""


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Substitute variables in every string value (keys are left as they are)."""
    if isinstance(node, str):
        return _VARIABLE.sub(lambda m: _substitute(m, env), node)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


def compose_variables(node: Any) -> dict[str, set[str | None]]:
    """Variables the string values of a parsed compose file read -> the `-`/`:-`
    defaults given (None: no default). Comments are not values: compose ignores them."""
    found: dict[str, set[str | None]] = {}
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            for name, defaults in compose_variables(item).items():
                found.setdefault(name, set()).update(defaults)
    elif isinstance(node, str):
        for match in _VARIABLE.finditer(node):
            name = match["bare"] or match["name"]
            if name:
                default = match["arg"] if match["op"] in (":-", "-") else None
                found.setdefault(name, set()).add(default)
    return found


def raw_compose() -> Any:
    """compose.yaml as parsed YAML (merge keys resolved), before interpolation."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def load_compose(env: Mapping[str, str]) -> dict[str, Any]:
    """compose.yaml with YAML merge keys resolved and `env` interpolated."""
    return interpolate(raw_compose(), env)


def stack_env(**overrides: str) -> dict[str, str]:
    """The variables of .env.example, with the required ones a user must fill in."""
    env = read_env_file()
    env["NPU_GID"] = env.get("NPU_GID") or "992"
    env.update(overrides)
    return env


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs in order, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, arguments = full.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    assert not pending, f"{path} ends inside a continued line"
    return instructions


def code_blocks(path: Path, language: str = "") -> list[str]:
    """Fenced code blocks of a Markdown file, optionally of one language."""
    return re.findall(rf"```{language}[a-z]*\n(.*?)```", path.read_text(), re.S)


def last_instruction(instructions: list[tuple[str, str]], keyword: str) -> str:
    """Arguments of the last `keyword` instruction (the one that takes effect)."""
    found = [arguments for kw, arguments in instructions if kw == keyword]
    assert found, f"no {keyword} instruction"
    return found[-1]


def exec_form(arguments: str) -> list[str]:
    """An instruction's exec-form (JSON array) arguments; shell form is split like sh."""
    if arguments.startswith("["):
        return json.loads(arguments)
    return shlex.split(arguments)


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last build stage (the image that runs)."""
    starts = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    return instructions[starts[-1] :]


def env_instructions(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """Variables set by ENV instructions (KEY=VALUE form)."""
    values: dict[str, str] = {}
    for keyword, arguments in instructions:
        if keyword == "ENV":
            for item in shlex.split(arguments):
                key, sep, value = item.partition("=")
                assert sep, f"ENV {arguments!r}: use the KEY=VALUE form"
                values[key] = value
    return values


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str | None]:
    """ARG names -> default (None when the ARG has none)."""
    values: dict[str, str | None] = {}
    for keyword, arguments in instructions:
        if keyword == "ARG":
            key, sep, value = arguments.partition("=")
            values.setdefault(key, value if sep else None)
    return values


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, patterns_file: Path = DOCKERIGNORE) -> bool:
    """Whether the builder leaves `path` (relative to the context) out of the context.

    As Docker does: the last pattern that matches the path or one of its parent
    folders decides, and `!` patterns put paths back.
    """
    patterns = [
        line.strip()
        for line in patterns_file.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored
