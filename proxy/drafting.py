"""The engine's view of a draft session: propose, draft with a stopping rule, draft ahead.

`AsyncSessionDrafter` drives one `npu_draft` session on its own worker thread
(`AsyncDraftSession`). Greedy rounds use these calls:

- `draft(committed, k_max, worth)`: up to k_max tokens after `committed`, one at a
  time, stopping at the first token the rule `worth(position, cumulative_p)` says is
  not worth verifying. Tokens already drafted beyond `committed` (during the previous
  verification, on either line below) are reused instead of recomputed.
- `branch(n_positions, n_tokens)`: a side line that replaces one of the first
  `n_positions` tokens of the main line by the draft's runner-up there (where that
  line is likeliest), drafted on for `n_tokens - 1` tokens; verified as extra prompts.
- `extend(n_max, cancel, predraft)`: keep drafting while the server verifies. The main
  line continues as if every pending draft is accepted; with `predraft`, a side line
  from the likeliest runner-up (the top correction, or the top bonus candidate)
  takes over once it is the likelier line to need its next token (only once: going
  back would cost a re-sync).

A line's chance of needing its next token is the product of the draft's p over the
line's tokens beyond the last committed sequence (the runner-up's own p included).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from npu_draft.protocol import CancelToken, Draft, DraftSession, SamplingParams
from npu_draft.sampling import choose_token

# worth(position, cumulative_probability) -> draft this position?  (position is 1-based)
StopRule = Callable[[int, float], bool]
Alternative = tuple[int, float] | None  # the draft's runner-up at a position and its p


def always(_position: int, _cumulative: float) -> bool:
    return True


@dataclass
class GreedyDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # the draft's softmax p per token
    reused: int = 0  # tokens taken from what was drafted ahead
    alternatives: list[Alternative] = field(default_factory=list)  # runner-up per token
    # the drafter's own time for the tokens this call drafted (not taken from drafting
    # ahead), and whether no line held the committed sequence (a re-sync)
    fresh_ms: float = 0.0
    fresh: int = 0
    resynced: bool = False


@dataclass
class Branch:
    """A second continuation to verify: `tokens[0]` replaces main-line draft `position`
    (0-based; position == len(draft) replaces the guess at the bonus)."""

    position: int
    tokens: list[int]
    probs: list[float]  # the draft's p of each token (the runner-up's own first)
    reach: float  # the draft's chance that the target accepts the main line up to position


class AsyncDrafter(Protocol):
    """Every call the engine and the drafter guard make on a draft session.

    A backend that only proposes inherits the rest from `DrafterBase`. The two flags
    say what the engine may plan on: `early_draft`, drafting the next round (through
    `draft`) while it commits this one; `draft_ahead`, calling `extend` while the
    server verifies (the draft length and the overlap policy count on it).
    """

    early_draft: bool
    draft_ahead: bool

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        """Up to k greedy draft tokens after `committed`."""
        ...

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        """Up to k_max tokens after `committed`, stopping where `worth` says; at most
        `k_fresh` where none was drafted ahead."""
        ...

    async def extend(self, n_max: int, cancel: CancelToken, predraft: bool = False) -> int:
        """Draft up to n_max more tokens while the server verifies; returns how many."""
        ...

    async def branch(self, n_positions: int, n_tokens: int) -> Branch | None:
        """A runner-up's line to verify beside the last draft, or None."""
        ...

    async def propose_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        """Sampling mode: k tokens drawn from the draft's q, with q where it has one."""
        ...

    async def close(self) -> None: ...


class DrafterBase(ABC):
    """The defaults of `AsyncDrafter` for a backend (or a test double) that only
    proposes: `draft` is a fixed-length `propose` without probabilities, nothing is
    drafted ahead or early, no branch, and sampling mode gets plain tokens without q
    (the acceptance rule then uses the point mass at each token, exact for any
    proposal)."""

    early_draft = False
    draft_ahead = False

    @abstractmethod
    async def propose(self, committed: Sequence[int], k: int) -> list[int]: ...

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        fresh = k_max if k_fresh is None else min(k_max, k_fresh)
        return GreedyDraft(tokens=list(await self.propose(committed, fresh)))

    async def extend(self, n_max: int, cancel: CancelToken, predraft: bool = False) -> int:
        return 0

    async def branch(self, n_positions: int, n_tokens: int) -> Branch | None:
        return None

    async def propose_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        return Draft(tokens=list(await self.propose(committed, k)))

    @abstractmethod
    async def close(self) -> None: ...


class _Line:
    """One drafted line: the whole sequence, of which `seq[:start]` was committed when
    the line was last rebased, and the draft's p and runner-up for each later token.

    Lives on the worker thread; only worker-thread functions touch it."""

    def __init__(self, seq: list[int], start: int) -> None:
        self.seq = seq
        self.start = start
        self.probs: list[float] = []
        self.alts: list[Alternative] = []

    def holds(self, committed: Sequence[int]) -> bool:
        """Whether `committed` is a prefix of this line (both share seq[:start])."""
        n = len(committed)
        return self.start <= n <= len(self.seq) and _same(self.seq, committed, self.start)

    def rebase(self, n: int) -> None:
        """Make seq[:n] the committed part."""
        self.probs = self.probs[n - self.start :]
        self.alts = self.alts[n - self.start :]
        self.start = n

    def ready(self) -> list[tuple[int, float, Alternative]]:
        return list(zip(self.seq[self.start :], self.probs, self.alts, strict=True))

    def likelihood(self) -> float:
        """The draft's chance that the target follows the line to its end."""
        return math.prod(self.probs)

    def side(self, n_positions: int | None = None) -> _Line | None:
        """The likeliest line that leaves this one at a runner-up (among its first
        `n_positions` drafted tokens, all by default), or None."""
        best: tuple[float, int, int, float] | None = None
        reach = 1.0
        positions = zip(self.probs[:n_positions], self.alts[:n_positions], strict=True)
        for i, (prob, alt) in enumerate(positions):
            if alt is not None and (best is None or reach * alt[1] > best[0]):
                best = (reach * alt[1], i, alt[0], alt[1])
            reach *= prob
        if best is None:
            return None
        _, i, token, prob = best
        side = _Line([*self.seq[: self.start + i], token], self.start)
        side.probs = [*self.probs[:i], prob]
        side.alts = [*self.alts[:i], None]
        return side


class _Lines:
    """The main line and at most one side line, both rooted at the last committed
    sequence, and which of them the session itself holds."""

    def __init__(self) -> None:
        self.main = _Line([], 0)
        self.side: _Line | None = None
        self.on_session: _Line | None = self.main
        self.resynced = False  # whether the last `take` had to sync the session

    def take(
        self, session: DraftSession, committed: Sequence[int]
    ) -> list[tuple[int, float, Alternative]]:
        """Tokens (p, runner-up) a line already holds after `committed`, which becomes
        the main line; [] after syncing to `committed` when no line holds it."""
        n = len(committed)
        for line in (self.main, self.side):
            if line is not None and line.holds(committed):
                line.rebase(n)
                self.main, self.side = line, None
                self.resynced = False
                return line.ready()
        session.sync(committed)
        self.main, self.side = _Line(list(committed), n), None
        self.on_session = self.main
        self.resynced = True
        return []

    def step(self, session: DraftSession, line: _Line) -> tuple[int, float, Alternative] | None:
        """Draft one more token on `line`; None when the session proposes none."""
        if self.on_session is not line:
            session.sync(line.seq)  # rolls back to the shared prefix: one short forward
            self.on_session = line
        draft = session.propose(1)
        if not draft.tokens:
            return None
        token = int(draft.tokens[0])
        prob = float(draft.probs[0]) if draft.probs else 1.0
        alt = draft.alternatives[0] if draft.alternatives else None
        line.seq.append(token)
        line.probs.append(prob)
        line.alts.append(alt)
        return token, prob, alt


def _same(have: Sequence[int], committed: Sequence[int], start: int) -> bool:
    """have[:len(committed)] == committed, knowing both share the first `start` tokens
    (the last sync); compares only the rest."""
    n = len(committed)
    if n - start < 64:
        return list(have[start:n]) == list(committed[start:n])
    a = np.asarray(have[start:n], dtype=np.int64)
    b = np.asarray(committed[start:n], dtype=np.int64)
    return bool(np.array_equal(a, b))


class AsyncSessionDrafter(DrafterBase):
    """Adapts `npu_draft.async_session.AsyncDraftSession` (one worker thread per
    session, cancellable between tokens) to what the engine calls."""

    early_draft = True
    draft_ahead = True

    def __init__(self, session: DraftSession, name: str = "draft") -> None:
        from npu_draft.async_session import AsyncDraftSession

        self._session = AsyncDraftSession(session, name)
        self._greedy_only = False
        self._lines = _Lines()

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        draft = await self.draft(committed, k, always)
        return draft.tokens

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        """Up to k_max drafts after `committed`; at most `k_fresh` where none of them
        was drafted ahead (each then costs a drafter step the round waits for)."""
        committed = list(committed)

        def work(session: DraftSession) -> GreedyDraft:
            out = GreedyDraft()
            lines = self._lines
            ready = lines.take(session, committed)
            out.resynced = lines.resynced
            limit = k_max if ready or k_fresh is None else min(k_max, k_fresh)
            cumulative = 1.0
            for position in range(1, limit + 1):
                from_line = position <= len(ready)
                if from_line:
                    token, prob, alt = ready[position - 1]
                else:  # every ready token is used: the line ends where we draft
                    started = time.perf_counter()
                    stepped = lines.step(session, lines.main)
                    if stepped is None:
                        break
                    out.fresh_ms += (time.perf_counter() - started) * 1e3
                    out.fresh += 1
                    token, prob, alt = stepped
                cumulative *= prob
                if position > 1 and not worth(position, cumulative):
                    break  # the token stays on the line: it guesses the bonus
                out.tokens.append(token)
                out.probs.append(prob)
                out.alternatives.append(alt)
                out.reused += from_line
            return out

        return await self._session.call(work)

    async def branch(self, n_positions: int, n_tokens: int) -> Branch | None:
        """The likeliest side line leaving the main line at one of its first
        `n_positions` tokens, `n_tokens` long; None where the draft has no runner-ups.
        Call after `draft`: the side line is rooted at the same committed sequence."""

        def work(session: DraftSession) -> Branch | None:
            lines = self._lines
            lines.side = lines.main.side(n_positions)
            side = lines.side
            if side is None:
                return None
            position = len(side.probs) - 1
            while len(side.probs) - position < n_tokens:
                if lines.step(session, side) is None:
                    break
            tokens = side.seq[side.start + position : side.start + position + n_tokens]
            probs = side.probs[position : position + len(tokens)]
            return Branch(position, tokens, probs, math.prod(side.probs[:position]))

        return await self._session.call(work)

    async def extend(self, n_max: int, cancel: CancelToken, predraft: bool = False) -> int:
        """Draft up to n_max more tokens while the server verifies; returns how many.
        With `predraft`, drafting moves to the side line once that is the likelier one."""

        def work(session: DraftSession) -> int:
            lines = self._lines
            if predraft and lines.side is None:
                lines.side = lines.main.side()
            made = 0
            line = lines.main
            while made < n_max and not cancel.cancelled:
                side = lines.side if predraft else None
                if side is not None and side.likelihood() > line.likelihood():
                    line = side  # and stay: each switch back would cost a re-sync
                if lines.step(session, line) is None:
                    break
                made += 1
            return made

        return await self._session.call(work)

    async def propose_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        """Sampling mode: tokens drawn from q (the mirrored chain) and q itself."""
        self._lines = _Lines()  # the sampled chain is not a greedy line to reuse
        await self._session.sync(committed)
        if not self._greedy_only:
            try:
                return await self._session.propose(k, sampling, rng)
            except NotImplementedError:
                self._greedy_only = True  # e.g. the numpy reference: sample its logits here
        return await self._step_sampled(list(committed), k, sampling, rng)

    async def _step_sampled(
        self, tokens: list[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        draft = Draft(dists=[])
        for i in range(k):
            if i > 0:
                await self._session.sync(tokens)  # feeds only the token just drawn
            token, prob, dist = choose_token(await self._session.next_logits(), sampling, rng)
            draft.tokens.append(token)
            draft.probs.append(prob)
            draft.dists.append(dist)  # type: ignore[union-attr]
            tokens.append(token)
        return draft

    async def close(self) -> None:
        await self._session.close()


__all__ = [
    "AsyncDrafter",
    "AsyncSessionDrafter",
    "Branch",
    "DrafterBase",
    "GreedyDraft",
    "StopRule",
    "always",
]
