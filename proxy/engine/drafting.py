"""The engine's view of a draft session: propose, draft with a stopping rule, draft ahead.

`AsyncSessionDrafter` drives one `npu_draft` session on its own worker thread
(`AsyncDraftSession`). Greedy rounds use these calls:

- `draft(committed, k_max, worth)`: up to k_max tokens after `committed`, one at a
  time, stopping at the first token the rule `worth(position, cumulative_p)` says is
  not worth verifying. Tokens already drafted beyond `committed` (during the previous
  verification) are reused instead of recomputed.
- `extend(n_max, cancel, sides)`: keep drafting while the server verifies: the line
  continues as if every pending draft is accepted; then, with `sides`, side lines
  for the likeliest other outcomes (a rejection at a pending draft, or of the bonus
  guess, whose correction is the draft's runner-up there), so that the next round
  can start at once after those too.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from npu_draft.protocol import CancelToken, Draft, DraftSession, SamplingParams
from npu_draft.sampling import choose_token

log = logging.getLogger(__name__)

# worth(position, cumulative_probability) -> draft this position?  (position is 1-based)
StopRule = Callable[[int, float], bool]


def always(_position: int, _cumulative: float) -> bool:
    return True


@dataclass(frozen=True)
class SidePlan:
    """Side lines to draft after the main line while the server verifies: the round
    verifies the line's next `verified` tokens; draft at most `lines` side lines
    (the rejection at draft 1 first, the bonus guess's last), `length` tokens each."""

    verified: int
    lines: int
    length: int


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
    from_side: bool = False  # the tokens came from a side line (`SidePlan`)


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

    async def extend(self, n_max: int, cancel: CancelToken, sides: SidePlan | None = None) -> int:
        """Draft up to n_max more tokens while the server verifies, then the side lines
        `sides` asks for; returns how many tokens of the main line."""
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
    drafted ahead or early, and sampling mode gets plain tokens without q
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

    async def extend(self, n_max: int, cancel: CancelToken, sides: SidePlan | None = None) -> int:
        return 0

    async def propose_sampled(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Draft:
        return Draft(tokens=list(await self.propose(committed, k)))

    @abstractmethod
    async def close(self) -> None: ...


class _Line:
    """The drafted line the session holds: the whole sequence, of which `seq[:start]`
    was committed when the line was last rebased, and the draft's p for each later token.
    With side lines (`SidePlan`) it also keeps the draft's runner-up for each drafted
    token and the side lines drafted from them; the session's cache then follows the
    line drafted last, and `step` syncs it back to `seq` first.

    Lives on the worker thread; only worker-thread functions touch it."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.start = 0
        self.probs: list[float] = []
        self.resynced = False  # whether the last `take` had to sync the session
        self.from_side = False  # whether the last `take` found a side line
        self.keep_runner_ups = False  # set once side lines are asked for
        self.lacks_logits = False  # the session has no logits: no runner-ups, no sides
        self.runner_ups: dict[int, int] = {}  # index in seq -> the draft's second choice
        # side lines: (sequence, p of the tokens after its base, runner-ups)
        self.sides: list[tuple[list[int], list[float], dict[int, int]]] = []
        self.synced = True  # the session's sequence is `seq`

    def take(self, session: DraftSession, committed: Sequence[int]) -> list[tuple[int, float]]:
        """Tokens (with p) the line, or one of its side lines, already holds after
        `committed`, which becomes its committed part; [] after syncing the session to
        `committed` where none does."""
        n = len(committed)
        self.from_side = False
        if not (self.start <= n <= len(self.seq) and _same(self.seq, committed, self.start)):
            side = self._side_for(committed)
            if side is None:
                session.sync(committed)
                self.seq, self.start, self.probs = list(committed), n, []
                self.runner_ups, self.sides, self.synced = {}, [], True
                self.resynced = True
                return []
            self.seq, self.start, self.probs, self.runner_ups = side
            self.synced, self.from_side = False, True
        self.probs = self.probs[n - self.start :]
        self.start = n
        self.sides = []
        self.runner_ups = {i: t for i, t in self.runner_ups.items() if i >= n}
        self.resynced = False
        return list(zip(self.seq[n:], self.probs, strict=True))

    def _side_for(
        self, committed: Sequence[int]
    ) -> tuple[list[int], int, list[float], dict[int, int]] | None:
        """(sequence, start, p, runner-ups) of the side line that holds `committed`."""
        n = len(committed)
        for seq, probs, runner_ups in self.sides:
            base = len(seq) - len(probs)
            # side lines share the committed part `seq[:start]` with the main line
            if base <= n <= len(seq) and _same(seq, committed, self.start):
                return seq, base, probs, runner_ups
        return None

    def sync(self, session: DraftSession) -> None:
        """Bring the session's cache back to `seq` (after side lines moved it)."""
        if not self.synced:
            session.sync(self.seq)
            self.synced = True

    def step(self, session: DraftSession) -> tuple[int, float] | None:
        """Draft one more token (keeping the draft's second choice there once side lines
        are asked for); None when the session proposes none."""
        self.sync(session)
        second = self._runner_up(session) if self.keep_runner_ups else None
        draft = session.propose(1)
        if not draft.tokens:
            return None
        token = int(draft.tokens[0])
        prob = float(draft.probs[0]) if draft.probs else 1.0
        if second is not None and second != token:
            self.runner_ups[len(self.seq)] = second
        self.seq.append(token)
        self.probs.append(prob)
        return token, prob

    def _runner_up(self, session: DraftSession) -> int | None:
        """The draft's second choice for the next token: the session's own
        `second_choice()` where it has one (the oracle: no vocabulary-wide logits to
        build on the drafter thread while the proxy parses a verify response), else
        from its logits; a drafter without logits (the n-gram one) has none, and side
        lines are then never drafted."""
        try:
            second_choice = getattr(session, "second_choice", None)
            if callable(second_choice):
                choice = second_choice()
                return None if choice is None else int(choice)
            return _second_choice(session.next_logits())
        except NotImplementedError:
            self.keep_runner_ups, self.lacks_logits = False, True
        except Exception:  # side lines are only speed: the drafting goes on without them
            log.warning("the draft's runner-up failed; no side lines", exc_info=True)
            self.keep_runner_ups, self.lacks_logits = False, True
        return None

    def draft_sides(self, session: DraftSession, plan: SidePlan, cancel: CancelToken) -> int:
        """Side lines while the server verifies `seq[start:start + plan.verified]`:
        for a rejection at each of those (and of the bonus guess after them), the line
        after the draft's runner-up there, `plan.length` tokens (with their own
        runner-ups, for the side lines of the round after); returns the tokens drafted.
        The session's cache is left on the last side line."""
        made = 0
        main = (self.seq, self.probs, self.runner_ups, self.synced)
        moved = False  # whether the session's cache left the main line
        try:
            for index in range(self.start, min(self.start + plan.verified + 1, len(main[0]))):
                if len(self.sides) >= plan.lines or cancel.cancelled:
                    break
                correction = main[2].get(index)
                if correction is None:
                    continue
                base = [*main[0][:index], correction]
                self.seq, self.probs, self.runner_ups = base, [], {}
                self.synced, moved = False, True
                for _ in range(plan.length):
                    if cancel.cancelled or self.step(session) is None:
                        break
                    made += 1
                if self.probs:  # a side line with nothing drafted is no line to start on
                    self.sides.append((self.seq, self.probs, self.runner_ups))
        finally:
            self.seq, self.probs, self.runner_ups, self.synced = main
            self.synced = self.synced and not moved
        return made


def _second_choice(logits: np.ndarray) -> int | None:
    """The id with the second-highest logit (two passes of argmax: far cheaper than a
    partial sort of a vocabulary)."""
    if logits.size < 2:
        return None
    if not logits.flags.writeable:  # a runtime's own buffer: mask a copy
        logits = logits.copy()
    first = int(np.argmax(logits))
    kept = logits[first]
    logits[first] = -np.inf
    try:
        return int(np.argmax(logits))
    finally:
        logits[first] = kept


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
            out.resynced, out.from_side = line.resynced, line.from_side
            limit = k_max if ready or k_fresh is None else min(k_max, k_fresh)
            cumulative = 1.0
            for position in range(1, limit + 1):
                from_line = position <= len(ready)
                if from_line:
                    token, prob = ready[position - 1]
                else:  # every ready token is used: the line ends where we draft
                    line.sync(session)  # back from a side line: not the drafter's step time
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

    async def extend(self, n_max: int, cancel: CancelToken, sides: SidePlan | None = None) -> int:
        """Draft up to n_max more tokens while the server verifies, then the side lines
        of `sides` while it still does; returns how many tokens of the main line."""

        def work(session: DraftSession) -> int:
            line = self._line
            with_sides = sides is not None and sides.lines > 0 and not line.lacks_logits
            line.keep_runner_ups |= with_sides
            made = 0
            while made < n_max and not cancel.cancelled:
                if line.step(session) is None:
                    break
                made += 1
            if with_sides and not cancel.cancelled:
                assert sides is not None
                line.draft_sides(session, sides, cancel)
            return made

        return await self._session.call(work)

    async def propose_sampled(
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
    "SidePlan",
    "StopRule",
    "always",
]
