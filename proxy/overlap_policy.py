"""Whether to draft ahead while the server verifies: measured, not assumed.

Drafting ahead saves the next round's drafting when the whole block (and the bonus
guess) is accepted. It costs nothing where the drafter has a processor of its own
(an NPU, or a CPU while the target runs on a GPU), but where drafter and server share
CPU cores it slows the verification it overlaps (measured on 2 cores: 37 -> 54 ms per
verify round). So the proxy measures both arms as it serves: for a round r, what the
choice affects is r's verification and the drafting that r+1 waits for. It keeps the
arm with the lower running mean of that sum, and re-tries the other arm now and then
because load changes.
"""

from __future__ import annotations

_ALPHA = 0.1  # weight of the newest sample in each arm's running mean
_MIN_SAMPLES = 4  # per arm, before the comparison decides
_RETRY_EVERY = 16  # rounds between tries of the arm that is losing


class OverlapPolicy:
    """Chooses, round by round, whether to draft during verification."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"overlap mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.cost_ms: dict[bool, float | None] = {True: None, False: None}
        self.samples: dict[bool, int] = {True: 0, False: 0}
        self.rounds = 0

    def choose(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        self.rounds += 1
        for arm in (True, False):  # explore: both arms need samples first
            if self.samples[arm] < _MIN_SAMPLES and self.samples[not arm] >= self.samples[arm]:
                return arm
        best = self.best()
        if self.rounds % _RETRY_EVERY == 0:
            return not best
        return best

    def best(self) -> bool:
        with_ahead, without = self.cost_ms[True], self.cost_ms[False]
        if with_ahead is None or without is None:
            return True
        return with_ahead <= without

    def observe(self, ahead: bool, verify_ms: float, next_draft_ms: float) -> None:
        """One round's verification and the drafting the following round waited for."""
        cost = verify_ms + next_draft_ms
        old = self.cost_ms[ahead]
        self.cost_ms[ahead] = cost if old is None else old + _ALPHA * (cost - old)
        self.samples[ahead] += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "chosen": self.best() if self.mode == "auto" else self.mode == "on",
            "cost_ms_with_ahead": self.cost_ms[True],
            "cost_ms_without": self.cost_ms[False],
            "samples": dict(self.samples),
        }
