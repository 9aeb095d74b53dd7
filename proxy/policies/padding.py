"""Whether to pad verify rounds to one batch shape (`--pad-rounds`): measured, not
assumed.

A padded round carries one more prompt, in a spare slot, that tops the batch up to the
one token count every round of its draft length then has (`proxy.engine.round_shape`).
Where the backend reuses a compute graph for a batch of the last one's shape (llama.cpp
b11434 on CUDA replays it as a CUDA graph), that saves more than the extra tokens cost:
on the H200 (14B f16, 512) a round of 3 drafts took 18.2-19.4 ms padded against
21.5-21.8 ms unpadded (docs/BENCHMARKS.md, "Padding decided on the GPU"). Where it
does not, the extra tokens only cost: on Strix Halo's Vulkan a padded round of 2 drafts
is 10 tokens, past the 8-token matrix-vector edge. The proxy cannot ask the server which
backend it runs (its /props says nothing of it), so in mode `auto` it measures:

- it measures each draft length apart: on the H200 padding saved 2.5-4.4 ms a round
  of 3 or 4 drafts and lost 5.6-7.8 ms at 5, where the padded batch (37 tokens) outgrows
  most unpadded ones;
- at each length it alternates blocks of rounds unpadded and padded (a block, not
  single rounds: CUDA replays a graph only from the third batch of one shape in a row,
  which is what a padded run of rounds gets in use), and stops after four padded rounds
  where they cost over 25% more than the unpadded ones;
- it compares their verify times over the rounds that could have been padded (the
  engine's own eligibility: the last round had as many drafts, no slot copies, a spare
  slot), leaving out rounds whose slots caught up;
- it pads a length once padding saves a share of its round (5%), stops once it loses
  or once enough rounds were compared without it winning; where the call was close
  (within 10%) it now and then re-tries the losing choice for a block, less and less
  often while the tries confirm it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from proxy.running_mean import running_mean

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord

log = logging.getLogger(__name__)

PadMode = Literal["auto", "on", "off"]

_ALPHA = 0.05  # weight of the newest sample in each running mean
BLOCK_ROUNDS = 8  # rounds in a row of one choice while exploring or re-trying
_MIN_SAMPLES = 12  # per choice at one length before its choice is made
_SETTLE_SAMPLES = 48  # ... after which exploring ends unpadded unless padding won
_MARGIN_MS = 0.5  # a difference this small a round is noise
# Padding that costs this much more than unpadded rounds after a few rounds of each is
# dropped at once: on Strix Halo's Vulkan a padded round of 2 drafts (10 tokens, past
# the 8-token edge) costs ~2.6 times an unpadded one, ~2 plain steps of the 32B more,
# and a full exploration (16 padded rounds) would cost a 3-turn chat ~4%. On CUDA the
# first two padded rounds of a block are not replayed yet (~+30%, H200), so four rounds
# stay within it where padding wins.
_HOPELESS_SHARE = 0.25
_HOPELESS_AFTER = 4  # rounds of each side
# Padding must save this share of an unpadded round to be chosen: it holds a slot more.
# On the H100 (14B f16, 512) no length gained that much (padded rounds of 5 drafts
# took ~1 ms less server time of ~25 in one run, more in the other) and always
# speculating ran ~3% slower with padding; on the H200 rounds of 3 and 4 drafts saved
# 11-17%.
_MARGIN_SHARE = 0.05
# Re-tries of the losing choice, for close calls only (the backend does not change under
# a running proxy; noise does): where padding is far slower, as at 2 drafts on Strix
# Halo's Vulkan (~2.6x), a block of it would cost more than any change it could catch
_CLOSE_SHARE = 0.10  # a close call: the saving is within this share of the round
RETRY_EVERY = 256  # rounds of a length between re-tries, at first
_RETRY_EVERY_MAX = 8192  # the interval doubles while the re-tries confirm the choice


@dataclass
class _Length:
    """One draft length's verify times, padded and not, and its choice."""

    verify_ms: dict[bool, float] = field(default_factory=dict)
    verify_n: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    chosen: bool | None = None  # None: still exploring
    rounds: int = 0  # its rounds decided
    block: bool = False  # the current block's choice
    block_left: int = 0
    retry_every: int = RETRY_EVERY
    next_retry: int = 0

    def decide(self) -> bool:
        self.rounds += 1
        if self.block_left > 0:
            self.block_left -= 1
            return self.block
        if self.chosen is None:  # explore: the choice with fewer samples, unpadded first
            return self._start_block(self.verify_n[True] < self.verify_n[False])
        if self.rounds >= self.next_retry and self._close_call():
            self.retry_every = min(2 * self.retry_every, _RETRY_EVERY_MAX)
            self.next_retry = self.rounds + self.retry_every
            return self._start_block(not self.chosen)
        return self.chosen

    def _start_block(self, padded: bool) -> bool:
        self.block, self.block_left = padded, BLOCK_ROUNDS - 1
        return padded

    def observe(self, padded: bool, verify_ms: float) -> bool | None:
        """One round's verify time; the new choice where it changed, else None."""
        self.verify_n[padded] += 1
        weight = max(1.0 / self.verify_n[padded], _ALPHA)
        self.verify_ms[padded] = running_mean(self.verify_ms.get(padded), verify_ms, weight)
        choice = self._verdict()
        if choice is None or choice == self.chosen:
            return None
        self.chosen, self.block_left = choice, 0  # a block in progress ends with the verdict
        self.retry_every, self.next_retry = RETRY_EVERY, self.rounds + RETRY_EVERY
        return choice

    def _hopeless(self) -> bool:
        """A few rounds of each side already show padding far slower."""
        if min(self.verify_n.values()) < _HOPELESS_AFTER:
            return False
        return self.verify_ms[True] > (1 + _HOPELESS_SHARE) * self.verify_ms[False]

    def _close_call(self) -> bool:
        saving = self.saving_ms()
        return saving is not None and abs(saving) < _CLOSE_SHARE * self.verify_ms[False]

    def saving_ms(self) -> float | None:
        """Verify time padding saves a round here; None until both sides have
        `_MIN_SAMPLES`."""
        if min(self.verify_n.values()) < _MIN_SAMPLES:
            return None
        return self.verify_ms[False] - self.verify_ms[True]

    def _verdict(self) -> bool | None:
        """Pad (True), do not (False), or no change (None; hysteresis between)."""
        if self.chosen is None and self._hopeless():
            return False
        saving = self.saving_ms()
        if saving is None:
            return None
        if saving >= max(_MARGIN_MS, _MARGIN_SHARE * self.verify_ms[False]):
            return True
        settled = self.chosen is None and min(self.verify_n.values()) >= _SETTLE_SAMPLES
        return False if saving <= -_MARGIN_MS or settled else None


class PaddingPolicy:
    """Chooses, for each round the engine could pad, whether it is padded (`decide`),
    and learns from each such round's verify time (`observe`), draft length by draft
    length."""

    def __init__(self, mode: PadMode = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"pad mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.lengths: dict[int, _Length] = {}

    def enabled(self) -> bool:
        """Whether a generation should keep the means to pad at all."""
        return self.mode != "off"

    def decide(self, k: int) -> bool:
        """Pad this round of k drafts (one the engine could pad)?"""
        if self.mode != "auto":
            return self.mode == "on"
        return self.lengths.setdefault(k, _Length()).decide()

    def trial(self, record: RoundRecord) -> bool:
        """Whether `record` was padded otherwise than its draft length now runs (a round
        of a block sent to compare the two shapes; a length runs unpadded until padding
        is chosen for it). Its verify time belongs to that comparison, not to what the
        length costs: on an H100 a padded round of 5 drafts took 37-50 ms against 28-34
        unpadded (docs/BENCHMARKS.md, "`--pad-rounds auto` end to end"). Ask before
        `observe`, which may change the choice."""
        if self.mode != "auto" or record.padded is None:
            return False
        length = self.lengths.get(record.n_drafted)
        return record.padded != bool(length is not None and length.chosen)

    def observe(self, record: RoundRecord) -> None:
        """A round the engine could pad (`record.padded` not None), with its verify time."""
        if self.mode != "auto" or record.padded is None or record.catch_up:
            return
        k = record.n_drafted
        length = self.lengths.setdefault(k, _Length())
        choice = length.observe(record.padded, record.verify_ms)
        if choice is not None:
            log.info(
                "rounds of %d drafts now %s (verify %.1f ms padded, %d rounds; %.1f ms "
                "unpadded, %d rounds)", k, "padded" if choice else "unpadded",
                length.verify_ms[True], length.verify_n[True], length.verify_ms[False],
                length.verify_n[False],
            )  # fmt: skip

    def padded_lengths(self) -> list[int]:
        """The draft lengths padded as things stand (unpadded while exploring)."""
        return sorted(k for k, length in self.lengths.items() if length.chosen)

    def saving_ms(self) -> float | None:
        """Verify time padding saves a round, over the lengths compared, weighted by
        their rounds; None before any length was."""
        total = weight = 0.0
        for length in self.lengths.values():
            saving = length.saving_ms()
            if saving is not None:
                n = min(length.verify_n.values())
                total, weight = total + n * saving, weight + n
        return total / weight if weight else None

    def snapshot(self) -> dict[str, object]:
        auto = self.mode == "auto"
        return {
            "mode": self.mode,
            "padded_lengths": self.padded_lengths() if auto else [],
            "chosen": bool(self.padded_lengths()) if auto else self.mode == "on",
            "deciding": auto and any(length.chosen is None for length in self.lengths.values()),
            "saving_ms": self.saving_ms(),
        }
