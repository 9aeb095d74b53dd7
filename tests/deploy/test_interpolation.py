"""The helpers the deployment tests stand on behave as Compose and Docker do."""

from __future__ import annotations

import pytest

from tests.deploy.stack import (
    InterpolationError,
    compose_variables,
    dockerfile_instructions,
    dockerignored,
    interpolate,
)

ENV = {"SET": "value", "EMPTY": ""}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${SET}", "value"),
        ("$SET/x", "value/x"),
        ("${UNSET}", ""),
        ("${UNSET:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("${UNSET-d}", "d"),
        ("${SET:-d}", "value"),
        ("${SET:+alt}", "alt"),
        ("${EMPTY:+alt}", ""),
        ("${EMPTY+alt}", "alt"),
        ("$$SET and $${SET}", "$SET and ${SET}"),
        ("$$(( a + 1 ))", "$(( a + 1 ))"),
        ("${SET:?needed}", "value"),
    ],
)
def test_interpolation_follows_the_compose_rules(text: str, expected: str) -> None:
    assert interpolate({"k": [text]}, ENV) == {"k": [expected]}


@pytest.mark.parametrize("text", ["${UNSET:?set UNSET}", "${EMPTY:?set EMPTY}", "${UNSET?x}"])
def test_required_variables_fail(text: str) -> None:
    with pytest.raises(InterpolationError):
        interpolate(text, ENV)


def test_compose_variables_collects_defaults() -> None:
    found = compose_variables(
        {"x": ["${A:-1} ${A} $B", {"y": "$${NOT_A_VARIABLE} ${C:?x} ${D-2}"}]}
    )
    assert found == {"A": {"1", None}, "B": {None}, "C": {None}, "D": {"2"}}


def test_dockerfile_continuations_and_comments(tmp_path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(
        "# syntax note\nARG X=1\nFROM a AS b\nRUN one \\\n    # inner comment\n    two\n"
        'CMD ["serve"]\n'
    )
    assert dockerfile_instructions(path) == [
        ("ARG", "X=1"),
        ("FROM", "a AS b"),
        ("RUN", "one two"),
        ("CMD", '["serve"]'),
    ]


def test_dockerignore_last_match_wins_and_covers_children(tmp_path) -> None:
    patterns = tmp_path / ".dockerignore"
    patterns.write_text("*\n!src/\n**/__pycache__\n!keep.gguf\n*.gguf\n")
    assert dockerignored(".venv/bin/python", patterns)
    assert not dockerignored("src/a/b.py", patterns)
    assert dockerignored("src/a/__pycache__/b.pyc", patterns)
    assert dockerignored("keep.gguf", patterns)
    assert not dockerignored("src", patterns)
