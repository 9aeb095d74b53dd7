"""The contributor document's "Code map" (docs/ARCHITECTURE.md) names every module of
proxy/ and npu_draft/ once, each under its own folder's heading, and nothing that is not
in the tree."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.stack import REPO

PACKAGES = ("proxy", "npu_draft")
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
ENTRY = re.compile(r"^- `([\w/]+\.py)`: \S")
HEADING = re.compile(r"^\*\*`([\w/]+/)`")


def code_map(document: str) -> list[str]:
    """The lines of the document's "Code map" section."""
    section = document.split("\n## Code map\n", 1)
    assert len(section) == 2, 'docs/ARCHITECTURE.md has no "## Code map" section'
    return section[1].split("\n## ", 1)[0].splitlines()


def mapped_modules(lines: list[str]) -> list[tuple[str, str]]:
    """(module path, the folder heading it stands under) for every entry line."""
    entries, folder = [], ""
    for line in lines:
        if heading := HEADING.match(line):
            folder = heading.group(1)
        elif entry := ENTRY.match(line):
            entries.append((entry.group(1), folder))
        else:
            assert not line.startswith("- "), f"code map line not in the form: {line!r}"
    return entries


def tree_modules() -> set[str]:
    """Every module file but the packages' `__init__.py` (the headings stand for those)."""
    files = (p for package in PACKAGES for p in (REPO / package).rglob("*.py"))
    return {p.relative_to(REPO).as_posix() for p in files if p.name != "__init__.py"}


def test_mapped_modules_parse() -> None:
    lines = ["**`proxy/`: one**", "- `proxy/a.py`: does a.", "**`proxy/api/`: two**"]
    lines += ["- `proxy/api/b.py`: does b.", "text"]
    assert mapped_modules(lines) == [("proxy/a.py", "proxy/"), ("proxy/api/b.py", "proxy/api/")]


def test_the_code_map_matches_the_tree() -> None:
    entries = mapped_modules(code_map(ARCHITECTURE.read_text()))
    mapped = [module for module, _ in entries]
    assert len(mapped) == len(set(mapped)), "a module is listed twice"
    tree = tree_modules()
    assert not tree - set(mapped), (
        f"missing from the code map in docs/ARCHITECTURE.md: {sorted(tree - set(mapped))}"
    )
    assert not set(mapped) - tree, (
        f"the code map names no such module: {sorted(set(mapped) - tree)}"
    )


def test_each_module_stands_under_its_folder() -> None:
    for module, folder in mapped_modules(code_map(ARCHITECTURE.read_text())):
        assert str(Path(module).parent) + "/" == folder, f"{module} listed under {folder}"
