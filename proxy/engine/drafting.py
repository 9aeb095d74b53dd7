"""What a drafter offers the engine (`AsyncDrafter`), and the adapter that drives one
`npu_draft` session as a drafted line (`AsyncSessionDrafter`).

Three calls, each named for what it does (the proposer, `proxy.engine.proposer`, is
the only caller, and bounds each of them):

- `draft(committed, k_max, worth)`: greedy, up to k_max tokens after `committed`, one at
  a time, stopping at the first token the rule `worth(position, cumulative_p)` says is
  not worth verifying. Tokens already drafted beyond `committed` (during the previous
  verification) are reused instead of recomputed.
- `extend(n_max, cancel, lines)`: keep drafting while the server verifies: the line
  continues as if every pending draft is accepted; then, while time is left
  (`RunnerUpLines`), the lines after the likeliest misses: the pending drafts accepted
  up to one the target rejects, then the draft's runner-up there. A later `draft` whose
  committed sequence ends on such a runner-up takes that line's tokens, ready.
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


@dataclass(frozen=True)
class RunnerUpLines:
    """What `extend` may draft after the all-accepted line: for the round in
    verification (`pending` drafts, then the bonus position), up to `most` lines of
    `length` tokens after the draft's runner-up at its likeliest misses; a line starts
    only where its tokens end by `until` (perf_counter s) at the measured step time."""

    pending: int
    length: int
    most: int
    until: float


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
    runner_up_line: bool = False  # its first tokens came from a line after a runner-up


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

    async def extend(
        self, n_max: int, cancel: CancelToken, lines: RunnerUpLines | None = None
    ) -> int:
        """Draft up to n_max more tokens while the server verifies, then the runner-up
        lines `lines` allows; returns how many tokens the all-accepted line gained."""
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

    async def extend(
        self, n_max: int, cancel: CancelToken, lines: RunnerUpLines | None = None
    ) -> int:
        return 0

    async def draft_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        return Draft(tokens=list(await self.propose(committed, k)))

    @abstractmethod
    async def close(self) -> None: ...


# a runner-up line's tokens, their p and their runner-ups
_Drafted = tuple[list[int], list[float], list[int]]


class _Line:
    """The drafted line the session holds: the whole sequence, of which `seq[:start]`
    was committed when the line was last rebased, and the draft's p and runner-up (-1:
    none offered) for each later token; and the lines drafted after runner-ups while the
    server verified (`branches`: (fork, runner-up) -> tokens after seq[:fork] + runner-up).

    Lives on the worker thread; only worker-thread functions touch it."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.start = 0
        self.probs: list[float] = []
        self.runner_ups: list[int] = []
        self.resynced = False  # whether the last `take` had to sync the session
        self.from_branch = False  # whether the last `take` found a runner-up line
        self.branches: dict[tuple[int, int], _Drafted] = {}
        # whether the session holds `seq` (drafting a runner-up line moves it away)
        self.session_on_line = True
        self.step_s = 0.0  # the last step's time

    def take(self, session: DraftSession, committed: Sequence[int]) -> list[tuple[int, float]]:
        """Tokens (with p) the line, or a runner-up line, already holds after
        `committed`, which becomes its committed part; [] after syncing the session to
        `committed` where none does."""
        n = len(committed)
        branches, self.branches = self.branches, {}
        self.from_branch = False
        if self.start <= n <= len(self.seq) and _same(self.seq, committed, self.start):
            self.probs = self.probs[n - self.start :]
            self.runner_ups = self.runner_ups[n - self.start :]
            self.start = n
            self.resynced = False
            return list(zip(self.seq[n:], self.probs, strict=True))
        fork = n - 1
        drafted = branches.get((fork, committed[-1])) if n else None
        if (
            drafted is not None
            and self.start <= fork
            and _same(self.seq, committed[:fork], self.start)
        ):
            tokens, self.probs, self.runner_ups = drafted
            self.seq, self.start = [*committed, *tokens], n
            self.session_on_line = False
            self.resynced = False
            self.from_branch = True
            return list(zip(tokens, self.probs, strict=True))
        session.sync(committed)
        self.seq, self.start, self.probs, self.runner_ups = list(committed), n, [], []
        self.session_on_line = True
        self.resynced = True
        return []

    def step(self, session: DraftSession) -> tuple[int, float] | None:
        """Draft one more token; None when the session proposes none."""
        started = time.perf_counter()
        if not self.session_on_line:
            session.sync(self.seq)  # back from a runner-up line: feeds only what differs
            self.session_on_line = True
        draft = session.propose(1)
        if not draft.tokens:
            return None
        token = int(draft.tokens[0])
        prob = float(draft.probs[0]) if draft.probs else 1.0
        self.seq.append(token)
        self.probs.append(prob)
        self.runner_ups.append(int(draft.runner_ups[0]) if draft.runner_ups else -1)
        self.step_s = time.perf_counter() - started
        return token, prob

    def likely_misses(self, pending: int) -> list[tuple[int, int]]:
        """(fork, runner-up) for each position of the round in verification (its
        `pending` drafts, then the bonus guess) whose runner-up is known, the likeliest
        miss first by the draft's own p (a drafter that reports none: earliest first)."""
        scored: list[tuple[float, int, int]] = []
        reach = 1.0
        for i in range(min(pending + 1, len(self.probs))):
            if self.runner_ups[i] >= 0:
                miss = reach * max(1.0 - self.probs[i], 1e-3)
                scored.append((-miss, self.start + i, self.runner_ups[i]))
            reach *= self.probs[i]
        return [(fork, token) for _, fork, token in sorted(scored)]

    def draft_runner_up_lines(
        self, session: DraftSession, lines: RunnerUpLines, cancel: CancelToken
    ) -> None:
        """The lines after the likeliest misses' runner-ups, while `lines.until` leaves
        time for each at the last step's time."""
        if lines.most <= 0 or lines.length <= 0:
            return
        for fork, token in self.likely_misses(lines.pending)[: lines.most]:
            end = time.perf_counter() + lines.length * max(self.step_s, 1e-4)
            if cancel.cancelled or end > lines.until:
                return
            session.sync([*self.seq[:fork], token])
            self.session_on_line = False
            draft = session.propose(lines.length, cancel=cancel)
            if not draft.tokens:
                continue
            n = len(draft.tokens)
            ups = list(draft.runner_ups) if len(draft.runner_ups) == n else [-1] * n
            probs = list(draft.probs) if len(draft.probs) == n else [1.0] * n
            self.branches[(fork, token)] = ([int(t) for t in draft.tokens], probs, ups)


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
    """Adapts `npu_draft.async_session.AsyncDraftSession` (one worker thread a
    session holds while open, cancellable between tokens) to what the engine calls."""

    early_draft = True
    draft_ahead = True

    def __init__(self, session: DraftSession) -> None:
        from npu_draft.async_session import AsyncDraftSession

        self._session = AsyncDraftSession(session)
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
            out.runner_up_line = line.from_branch
            limit = k_max if ready or k_fresh is None else min(k_max, k_fresh)
            cumulative = 1.0
            for position in range(1, limit + 1):
                from_line = position <= len(ready)
                if from_line:
                    token, prob = ready[position - 1]
                else:  # every ready token is used: the line ends where we draft
                    stepped = line.step(session)
                    if stepped is None:
                        break
                    out.fresh_ms += line.step_s * 1e3
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

    async def extend(
        self, n_max: int, cancel: CancelToken, lines: RunnerUpLines | None = None
    ) -> int:
        """Draft up to n_max more tokens while the server verifies, then the runner-up
        lines `lines` allows; returns how many tokens the all-accepted line gained."""

        def work(session: DraftSession) -> int:
            made = 0
            while made < n_max and not cancel.cancelled:
                if self._line.step(session) is None:
                    break
                made += 1
            if lines is not None:
                self._line.draft_runner_up_lines(session, lines, cancel)
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
    "RunnerUpLines",
    "StopRule",
    "always",
]
