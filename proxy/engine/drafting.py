"""What a drafter offers the engine (`AsyncDrafter`), and the adapter that drives one
`npu_draft` session as a drafted line (`AsyncSessionDrafter`).

Three calls, each named for what it does (the proposer, `proxy.engine.proposer`, is
the only caller, and bounds each of them):

- `draft(committed, k_max, worth)`: greedy, up to k_max tokens after `committed`, one at
  a time, stopping at the first token the rule `worth(position, cumulative_p)` says is
  not worth verifying. Tokens already drafted beyond `committed` (during the previous
  verification) are reused instead of recomputed.
- `extend(n_max, cancel)`: keep drafting while the server verifies: the line
  continues as if every pending draft is accepted.
- `draft_sampled(committed, k, sampling, rng)`: sampling, k draws from the draft's q.

A test double or a simple backend implements only `propose(committed, k)` (k greedy
tokens) and `close`; `DrafterBase` derives the three calls from it.
"""

from __future__ import annotations

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


def always(_position: int, _cumulative: float) -> bool:
    return True


@dataclass
class GreedyDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # the draft's softmax p per token
    reused: int = 0  # tokens taken from what was drafted ahead
    # the drafter's own time for the tokens this call drafted (not taken from drafting
    # ahead), and whether no line held the committed sequence (a re-sync)
    fresh_ms: float = 0.0
    fresh: int = 0
    resynced: bool = False


class AsyncDrafter(Protocol):
    """Every call the proposer makes on a draft session.

    A backend that only proposes inherits the rest from `DrafterBase`. The two flags
    say what the engine may plan on: `early_draft`, drafting the next round (through
    `draft`) while it commits this one; `draft_ahead`, calling `extend` while the
    server verifies (the draft length and the overlap policy count on it).
    """

    early_draft: bool
    draft_ahead: bool

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        """Up to k_max tokens after `committed`, stopping where `worth` says; at most
        `k_fresh` where none was drafted ahead."""
        ...

    async def extend(self, n_max: int, cancel: CancelToken) -> int:
        """Draft up to n_max more tokens while the server verifies; returns how many."""
        ...

    async def draft_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        """Sampling mode: k tokens drawn from the draft's q, with q where it has one."""
        ...

    async def close(self) -> None: ...


class DrafterBase(ABC):
    """The defaults of `AsyncDrafter` for a backend (or a test double) that only
    proposes: `draft` is a fixed-length `propose` without probabilities, nothing is
    drafted ahead or early, and `draft_sampled` gives plain tokens without q
    (the acceptance rule then uses the point mass at each token, exact for any
    proposal)."""

    early_draft = False
    draft_ahead = False

    @abstractmethod
    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        """Up to k greedy draft tokens after `committed`: all such a backend offers."""

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        fresh = k_max if k_fresh is None else min(k_max, k_fresh)
        return GreedyDraft(tokens=list(await self.propose(committed, fresh)))

    async def extend(self, n_max: int, cancel: CancelToken) -> int:
        return 0

    async def draft_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        return Draft(tokens=list(await self.propose(committed, k)))

    @abstractmethod
    async def close(self) -> None: ...


class _Line:
    """The drafted line the session holds: the whole sequence, of which `seq[:start]`
    was committed when the line was last rebased, and the draft's p for each later token.

    Lives on the worker thread; only worker-thread functions touch it."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.start = 0
        self.probs: list[float] = []
        self.resynced = False  # whether the last `take` had to sync the session

    def take(self, session: DraftSession, committed: Sequence[int]) -> list[tuple[int, float]]:
        """Tokens (with p) the line already holds after `committed`, which becomes its
        committed part; [] after syncing the session to `committed` where it does not."""
        n = len(committed)
        if self.start <= n <= len(self.seq) and _same(self.seq, committed, self.start):
            self.probs = self.probs[n - self.start :]
            self.start = n
            self.resynced = False
            return list(zip(self.seq[n:], self.probs, strict=True))
        session.sync(committed)
        self.seq, self.start, self.probs = list(committed), n, []
        self.resynced = True
        return []

    def step(self, session: DraftSession) -> tuple[int, float] | None:
        """Draft one more token; None when the session proposes none."""
        draft = session.propose(1)
        if not draft.tokens:
            return None
        token = int(draft.tokens[0])
        prob = float(draft.probs[0]) if draft.probs else 1.0
        self.seq.append(token)
        self.probs.append(prob)
        return token, prob


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
        self._line = _Line()

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
            line = self._line
            ready = line.take(session, committed)
            out.resynced = line.resynced
            limit = k_max if ready or k_fresh is None else min(k_max, k_fresh)
            cumulative = 1.0
            for position in range(1, limit + 1):
                from_line = position <= len(ready)
                if from_line:
                    token, prob = ready[position - 1]
                else:  # every ready token is used: the line ends where we draft
                    started = time.perf_counter()
                    stepped = line.step(session)
                    if stepped is None:
                        break
                    out.fresh_ms += (time.perf_counter() - started) * 1e3
                    out.fresh += 1
                    token, prob = stepped
                cumulative *= prob
                if position > 1 and not worth(position, cumulative):
                    break  # the token stays on the line: it guesses the bonus
                out.tokens.append(token)
                out.probs.append(prob)
                out.reused += from_line
            return out

        return await self._session.call(work)

    async def extend(self, n_max: int, cancel: CancelToken) -> int:
        """Draft up to n_max more tokens while the server verifies; returns how many."""

        def work(session: DraftSession) -> int:
            made = 0
            while made < n_max and not cancel.cancelled:
                if self._line.step(session) is None:
                    break
                made += 1
            return made

        return await self._session.call(work)

    async def draft_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        """Sampling mode: tokens drawn from q (the mirrored chain) and q itself."""
        self._line = _Line()  # the sampled chain is not a greedy line to reuse
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
    "DrafterBase",
    "GreedyDraft",
    "StopRule",
    "always",
]
