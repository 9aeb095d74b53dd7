"""Whether to pad verify rounds to one batch shape (`--pad-rounds`): measured, not
assumed.

A padded round carries one more prompt, in a spare slot, that tops the batch up to the
one token count every round of its draft length then has (`proxy.engine.round_shape`).
Where the backend reuses a compute graph for a batch of the last one's shape (llama.cpp
b11434 on CUDA replays it as a CUDA graph), that saves more than the extra tokens cost:
on the H200 (14B f16, 512) a round of 3 drafts took 18.2-19.4 ms padded against
21.5-21.8 ms unpadded (docs/BENCHMARKS.md, "Padding on the H200: the A/B"). Where it
does not, the extra tokens only cost: on Strix Halo's Vulkan a padded round of 2 drafts
is 10 tokens, past the 8-token matrix-vector edge. The proxy cannot ask the server which
backend it runs (its /props says nothing of it), so in mode `auto` it measures:

- it alternates blocks of rounds padded and unpadded (a block, not single rounds:
  CUDA replays a graph only from the third batch of one shape in a row, which is what
  a padded run of rounds gets in use);
- it compares their verify times at equal draft lengths, over the rounds that could
  have been padded (the engine's own eligibility: the last round had as many drafts, no
  slot copies, a spare slot), leaving out rounds whose slots caught up;
- it pads once padding is faster by a margin, and now and then re-tries the losing
  choice for a block, less and less often while the tries confirm the choice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from proxy.running_mean import running_mean

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord

log = logging.getLogger(__name__)

PadMode = Literal["auto", "on", "off"]

_ALPHA = 0.05  # weight of the newest sample in each running mean
BLOCK_ROUNDS = 8  # rounds in a row of one choice while exploring or re-trying
_MIN_PER_LENGTH = 4  # samples per choice at one draft length for it to count
_MIN_SAMPLES = 12  # compared samples (summed over lengths) before the choice is made
_MARGIN_MS = 0.5  # padding must save this much a round (it holds a slot more)
RETRY_EVERY = 128  # eligible rounds between re-tries of the losing choice, at first
_RETRY_EVERY_MAX = 4096  # the interval doubles while the re-tries confirm the choice


class PaddingPolicy:
    """Chooses, for each round the engine could pad, whether it is padded (`decide`),
    and learns from each such round's verify time (`observe`)."""

    def __init__(self, mode: PadMode = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"pad mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        # (padded?, drafts) -> mean verify ms, and its count
        self.verify_ms: dict[tuple[bool, int], float] = {}
        self.verify_n: dict[tuple[bool, int], int] = {}
        self.rounds = 0  # eligible rounds decided
        self._chosen: bool | None = None  # None: still exploring
        self._block: bool = False  # the current block's choice
        self._block_left = 0
        self._retry_every = RETRY_EVERY
        self._next_retry = 0

    def enabled(self) -> bool:
        """Whether a generation should keep the means to pad at all."""
        return self.mode != "off"

    def decide(self) -> bool:
        """Pad this round (one the engine could pad)?"""
        if self.mode != "auto":
            return self.mode == "on"
        self.rounds += 1
        if self._block_left > 0:
            self._block_left -= 1
            return self._block
        if self._chosen is None:  # explore: the choice with fewer compared samples
            return self._start_block(self._samples(True) <= self._samples(False))
        if self.rounds >= self._next_retry:
            self._retry_every = min(2 * self._retry_every, _RETRY_EVERY_MAX)
            self._next_retry = self.rounds + self._retry_every
            return self._start_block(not self._chosen)
        return self._chosen

    def _start_block(self, padded: bool) -> bool:
        self._block, self._block_left = padded, BLOCK_ROUNDS - 1
        return padded

    def _samples(self, padded: bool) -> int:
        return sum(n for (p, _), n in self.verify_n.items() if p == padded)

    def saving_ms(self) -> float | None:
        """Verify time padding saves a round, over the draft lengths seen often enough
        both ways, weighted by how often; None until `_MIN_SAMPLES` are compared."""
        total = weight = 0.0
        for (padded, k), unpadded_ms in self.verify_ms.items():
            if padded or (True, k) not in self.verify_ms:
                continue
            counts = min(self.verify_n[(True, k)], self.verify_n[(False, k)])
            if counts >= _MIN_PER_LENGTH:
                total += counts * (unpadded_ms - self.verify_ms[(True, k)])
                weight += counts
        return total / weight if weight >= _MIN_SAMPLES else None

    def chosen(self) -> bool:
        """The choice as things stand (unpadded while exploring)."""
        if self.mode != "auto":
            return self.mode == "on"
        return bool(self._chosen)

    def observe(self, record: RoundRecord) -> None:
        """A round the engine could pad (`record.padded` not None), with its verify time."""
        if self.mode != "auto" or record.padded is None or record.catch_up:
            return
        key = (record.padded, record.n_drafted)
        self.verify_n[key] = self.verify_n.get(key, 0) + 1
        self.verify_ms[key] = running_mean(
            self.verify_ms.get(key), record.verify_ms, max(1.0 / self.verify_n[key], _ALPHA)
        )
        saving = self.saving_ms()
        if saving is None or abs(saving) < _MARGIN_MS:
            return  # hysteresis: no flapping on noise
        before, self._chosen = self._chosen, saving > 0
        if before != self._chosen:
            self._retry_every = RETRY_EVERY
            self._next_retry = self.rounds + RETRY_EVERY
            log.info(
                "padded rounds now %s (padding saves %.1f ms a round)",
                "on" if self._chosen else "off", saving,
            )  # fmt: skip

    def snapshot(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "chosen": self.chosen(),
            "deciding": self.mode == "auto" and self._chosen is None,
            "saving_ms": self.saving_ms(),
        }
