"""Errors the user can fix: the CLI prints them as one line, without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A message that says what is wrong and how to fix it."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        super().__init__(f"{problem} (fix: {fix})" if fix else problem)
