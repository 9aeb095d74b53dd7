"""The packages' imports form no circle: every module can be read on its own, bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "npu_draft")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules this file imports anywhere (a function-level import that closes
    a circle only hides it until the function runs)."""
    name = _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module or "", node.level, name, path.stem == "__init__")
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known}
    # a package's __init__ importing its own modules is how packages re-export
    return {m for m in found if m != name and not m.startswith(f"{name}.")}


def import_graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    known = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, known) for p in files}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[node], _ = 2, path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def test_find_circle_finds_one() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    graph = import_graph()
    assert any(m.startswith(package) for m in graph)
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])
