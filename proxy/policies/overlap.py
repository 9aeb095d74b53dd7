"""Whether to draft ahead while the server verifies: measured, not assumed.

Drafting ahead saves the next round's drafting when the whole block (and the bonus
guess) is accepted. It costs nothing where the drafter has a processor of its own
(an NPU, or a CPU while the target runs on a GPU), but where drafter and server share
CPU cores it slows the verification it overlaps (by over a third on 2 cores;
docs/BENCHMARKS.md, "Measurements behind design choices"). So the proxy measures both
sides as it serves:

- the saving, in the round after one that drafted ahead: what drafting its tokens
  fresh would have cost (tokens x the per-token drafting time measured after rounds
  that did not draft ahead) minus the drafting it actually waited for (a miss still
  waits for the token being drafted ahead);
- the penalty: verify time with drafting ahead minus verify time without, compared at
  equal draft lengths and equal prompt tokens ingested (both change the verify time far
  more than the overlap), leaving out rounds whose slots caught up.

Keyed by draft length alone, the comparison took the batch's size for the overlap's
cost. On Strix Halo's Vulkan a round whose slots lag by a few tokens more crosses the
8-token edge and costs three times as much; a few such rounds in a running mean swung
the penalty between -4 ms and +15 ms, and on the 32B regime (emulated) drafting ahead
went off and on ten times in one 2,400-token chat run, each time for tens of rounds that
drafted fresh.

It keeps drafting ahead while the mean saving exceeds the mean penalty, and re-tries
the losing choice now and then because load changes (less and less often while the
tries confirm the choice).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord

log = logging.getLogger(__name__)

OverlapMode = Literal["auto", "on", "off"]

_ALPHA = 0.05  # weight of the newest sample in each running mean
_HYSTERESIS_MS = 1.0  # switch only when the other choice looks better by this much
_MIN_SAMPLES = 12  # per choice, before the comparison decides (verify times are noisy)
_MIN_PER_LENGTH = 3  # samples per choice at one draft length for it to count
_RETRY_EVERY = 8  # rounds between tries of the losing choice, at first
_RETRY_EVERY_MAX = 64  # the interval doubles while the tries confirm the choice


def _mean(old: float | None, new: float, count: int) -> float:
    """Running mean: exact over the first 1/_ALPHA samples, then exponential."""
    return new if old is None else old + max(1.0 / count, _ALPHA) * (new - old)


class OverlapPolicy:
    """Chooses, round by round, whether to draft during verification (`decide`), and
    learns from each round that chose once the next round's draft is ready (`observe`).
    Mode `off` never drafts ahead and has nothing to learn."""

    def __init__(self, mode: OverlapMode = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"overlap mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        # (ahead?, drafts, prompt tokens ingested) -> mean verify ms, and its count
        self.verify_ms: dict[tuple[bool, int, int], float] = {}
        self.verify_n: dict[tuple[bool, int, int], int] = {}
        self.samples: dict[bool, int] = {True: 0, False: 0}
        self.saving_ms: float | None = None
        self.saving_n = 0
        self.draft_ms_per_token: float | None = None
        self.draft_n = 0
        self.rounds = 0
        self._current = True
        # Each try of the losing choice costs a round without its benefit (drafting
        # ahead on an NPU costs verification nothing: a try of "off" only loses), so the
        # interval doubles each time the choice survives one, back to the start on a switch.
        self._retry_every = _RETRY_EVERY
        self._next_retry = _RETRY_EVERY

    def expects_ahead(self) -> bool:
        """Whether rounds draft ahead as things stand (what the draft length assumes)."""
        return self.mode == "on" or (self.mode == "auto" and self.best())

    def decide(self, able: bool) -> bool | None:
        """Draft ahead while the server verifies this round's draft? None in mode `off`
        (no choice, nothing to judge later); False where the drafter cannot (a choice all
        the same: its verify time is the "without" side)."""
        if self.mode == "off":
            return None
        if not able:
            return False
        if self.mode == "on":
            return True
        self.rounds += 1
        if self.saving_n < _MIN_SAMPLES or min(self.samples.values()) < _MIN_SAMPLES:
            return self.samples[True] <= self.samples[False]  # explore: alternate
        best = self.best()
        if self.rounds < self._next_retry:
            return best
        self._retry_every = min(2 * self._retry_every, _RETRY_EVERY_MAX)
        self._next_retry = self.rounds + self._retry_every
        return not best

    def penalty_ms(self) -> float | None:
        """Extra verify time with drafting ahead, over the batch shapes (draft length,
        prompt tokens) seen often enough both ways, weighted by how often."""
        total = weight = 0.0
        for (ahead, *shape), with_ms in self.verify_ms.items():
            if not ahead:
                continue
            without = (False, *shape)
            counts = min(self.verify_n[(True, *shape)], self.verify_n.get(without, 0))
            if counts >= _MIN_PER_LENGTH:
                total += counts * (with_ms - self.verify_ms[without])
                weight += counts
        return total / weight if weight else None

    def best(self) -> bool:
        """The choice the measurements support (drafting ahead until they exist)."""
        return self._current

    def observe(self, record: RoundRecord) -> None:
        """A round that chose (`drafted_ahead`), with its draft length and verify time,
        and the drafting the next round waited for (`next_drafted`, `next_draft_ms`)."""
        ahead, next_drafted = record.drafted_ahead, record.next_drafted
        if ahead is None or next_drafted is None:
            return
        before = self._current
        if not record.catch_up:
            key = (ahead, record.n_drafted, record.server_prompt_tokens)
            self.verify_n[key] = self.verify_n.get(key, 0) + 1
            self.verify_ms[key] = _mean(
                self.verify_ms.get(key), record.verify_ms, self.verify_n[key]
            )
        self.samples[ahead] += 1
        if next_drafted > 0:
            self._learn_drafting(ahead, next_drafted, record.next_draft_ms)
        penalty = self.penalty_ms()
        if penalty is not None and self.saving_ms is not None:
            margin = self.saving_ms - penalty
            if abs(margin) >= _HYSTERESIS_MS:  # hysteresis: no flapping on noise
                self._current = margin > 0
        if self._current != before:
            self._retry_every = _RETRY_EVERY
            self._next_retry = self.rounds + _RETRY_EVERY
        if self._current != before and self.saving_n >= _MIN_SAMPLES:
            log.info(
                "drafting ahead now %s (saves %.1f ms of drafting, costs %.1f ms of verify)",
                "on" if self.best() else "off", self.saving_ms or 0.0, self.penalty_ms() or 0.0,
            )  # fmt: skip

    def _learn_drafting(self, ahead: bool, next_drafted: int, next_draft_ms: float) -> None:
        """After a round without drafting ahead, every token of the next draft was made
        fresh: its per-token time. After one with, the saving against that time."""
        if not ahead:
            self.draft_n += 1
            self.draft_ms_per_token = _mean(
                self.draft_ms_per_token, next_draft_ms / next_drafted, self.draft_n
            )
        elif self.draft_ms_per_token is not None:
            fresh_cost = next_drafted * self.draft_ms_per_token
            self.saving_n += 1
            self.saving_ms = _mean(self.saving_ms, fresh_cost - next_draft_ms, self.saving_n)

    def snapshot(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "chosen": self.best() if self.mode == "auto" else self.mode == "on",
            "saving_ms": self.saving_ms,
            "penalty_ms": self.penalty_ms(),
            "samples": dict(self.samples),
        }
