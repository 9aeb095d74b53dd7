"""BENCHMARKS.md and VULKAN.md read as user documentation: their commands parse, their
links resolve, their headings describe content rather than internal work items, and no
doc sends a user to a folder that is not in the repository."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from proxy import cli
from tests.deploy.stack import REPO, code_blocks

DOCS = REPO / "docs"
BENCHMARKS, VULKAN = DOCS / "BENCHMARKS.md", DOCS / "VULKAN.md"
USER_DOCS = (BENCHMARKS, VULKAN)
ALL_MARKDOWN = sorted([REPO / "README.md", *DOCS.rglob("*.md")])
# working folders of the development machines, never part of the repository
PRIVATE_FOLDERS = (".vk/", ".gpu/", ".gpu-tree/", ".llama-src/")
INTERNAL_HEADING = re.compile(r"\b(issue|work item|session)\b", re.I)


def npu_spec_commands(path: Path) -> list[list[str]]:
    """`npu-spec ...` lines of the doc's bash blocks, continuation lines joined."""
    commands = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("npu-spec "):
                commands.append(shlex.split(line))
    return commands


def test_the_benchmark_summary_comes_first_and_shows_how_to_measure() -> None:
    text = BENCHMARKS.read_text()
    first_section = text.split("\n## ")[1]
    assert first_section.startswith("Summary")
    assert "npu-spec verify-cost" in first_section and "npu-spec bench" in first_section
    assert "2-layer" in first_section  # the unfair builtin reference is called out
    assert "0.6B" in first_section and "Fair A/B on the H200" in first_section


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_npu_spec_commands_parse(path: Path, monkeypatch) -> None:
    commands = npu_spec_commands(path)
    if path == BENCHMARKS:
        assert {c[1] for c in commands} >= {"bench", "verify-cost"}
    for command in commands:
        assert command[1] in cli.SUBCOMMANDS, f"{path.name}: no subcommand {command[1]!r}"
        monkeypatch.setattr(sys, "argv", command)
        cli.build_parser().parse_args(command[1:])  # exits on an unknown option


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_headings_describe_content(path: Path) -> None:
    headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
    assert headings
    for heading in headings:
        assert not INTERNAL_HEADING.search(heading), f"{path.name}: {heading!r}"


@pytest.mark.parametrize("path", ALL_MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_no_private_working_folders(path: Path) -> None:
    text = path.read_text()
    for folder in PRIVATE_FOLDERS:
        assert f"`{folder}" not in text and f" {folder}" not in text, f"{path.name}: {folder}"


@pytest.mark.parametrize("path", ALL_MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        assert (path.parent / target).exists(), f"{path.relative_to(REPO)}: {target}"
