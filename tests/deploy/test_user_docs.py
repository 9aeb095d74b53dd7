"""The README is a user's guide: short, no run logs, exactly two set-up commands, and
the speed claims in one section that names each claim's regime. BENCHMARKS.md,
VULKAN.md, RPC.md and ARCHITECTURE.md read as documentation too: their commands parse,
their links resolve, their headings describe content rather than internal work items,
and no doc sends a user to a folder that is not in the repository."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from proxy import cli
from tests.deploy.stack import REPO, code_blocks

DOCS = REPO / "docs"
README = REPO / "README.md"
BENCHMARKS, VULKAN = DOCS / "BENCHMARKS.md", DOCS / "VULKAN.md"
USER_DOCS = (README, BENCHMARKS, VULKAN, DOCS / "RPC.md", DOCS / "ARCHITECTURE.md")
README_MAX_LINES = 200
# what a development log says and a user's guide does not
RUN_LOG = re.compile(
    r"\b(second|third|fourth|fifth|sixth|latest) run\b|run of the day|not explained|"
    r"not yet found|no machine was lent|sandbox|\b20\d\d-\d\d-\d\d\b|\bwe (tried|found)\b",
    re.I,
)
SET_UP_COMMANDS = ["scripts/demo.sh", "scripts/test.sh"]
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


def readme_section(title: str) -> str:
    parts = README.read_text().split(f"\n## {title}\n", 1)
    assert len(parts) == 2, f'README has no "## {title}" section'
    return parts[1].split("\n## ", 1)[0]


def test_the_readme_is_a_short_users_guide() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    logged = [m.group(0) for m in RUN_LOG.finditer(text)]
    assert not logged, f"README reads as a run log: {logged}"
    assert "## Code map" not in text  # the code map is for contributors
    assert "(docs/ARCHITECTURE.md)" in text and "(docs/BENCHMARKS.md)" in text


def test_the_run_log_pattern_catches_a_log() -> None:
    assert RUN_LOG.search("Fifth run of the day: 0.9x, not explained (2026-12-01)")
    assert not RUN_LOG.search("The proxy measures both ways and keeps the faster.")


def test_a_fresh_machine_needs_exactly_two_commands() -> None:
    blocks = code_blocks(README, "bash")
    first = [line.split("#")[0].strip() for line in blocks[0].splitlines()]
    assert [line for line in first if line] == SET_UP_COMMANDS
    for block in blocks:  # no other set-up script anywhere in the README
        for script in re.findall(r"scripts/[\w.]+", block):
            assert script in SET_UP_COMMANDS, script
    for script in SET_UP_COMMANDS:
        assert (REPO / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_the_readme_says_what_the_commands_cost_and_how_to_see_speculation() -> None:
    fresh = readme_section("On a fresh Linux machine: two commands")
    for cost in ("min", "GB", "PyTorch", "chromium", "apt-get", "root", "skips"):
        assert cost in fresh, cost
    assert "scripts/demo.sh --plain-runs off" in fresh
    assert "X-Npu-Spec: speculative" in fresh and "X-Npu-Spec: passthrough" in fresh


def test_where_speculation_pays_names_each_regime() -> None:
    section = readme_section("Where speculation pays")
    assert len(section.strip().splitlines()) <= 40  # compact, replaced as a whole
    claims = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- |\Z)", section, re.M | re.S)
    regimes = [regime for regime, _ in claims]
    for backend in ("CPU", "H200", "Strix Halo", "RPC"):
        assert any(backend in regime for regime in regimes), backend
    for regime, claim in claims:
        assert re.search(r"\d", claim), f"{regime}: no figure"
        # a speed figure says in what units: plain steps, x plain, tokens/s
        assert re.search(r"steps?|x plain|x of|tokens/s|gain", claim), regime
