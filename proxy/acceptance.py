"""Acceptance rules: pure functions from (draft, target verdicts) to committed tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Acceptance:
    n_accepted: int  # leading draft tokens the target agreed with
    tokens: list[int]  # what the round commits: accepted drafts + the target's own token
    n_drafted: int

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted and the last token is the free one."""
        return self.n_drafted > 0 and self.n_accepted == self.n_drafted


def greedy_accept(draft: Sequence[int], target: Sequence[int]) -> Acceptance:
    """Greedy rule: keep drafts while they equal the target's argmax, then its token.

    target[i] is the target's greedy token after the context plus draft[:i], so
    len(target) == len(draft) + 1. The result is exactly what plain greedy decoding
    would have produced for those positions.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target tokens for {len(draft)} drafts")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return Acceptance(n_accepted=n, tokens=[*draft[:n], target[n]], n_drafted=len(draft))


def accepted_per_position(n_accepted: int, n_drafted: int) -> list[bool]:
    """Which draft positions (0-based) were accepted in one round, for per-position stats."""
    return [i < n_accepted for i in range(n_drafted)]
