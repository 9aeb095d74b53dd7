"""The engine's view of a draft session: propose, draft with a stopping rule, draft ahead.

`AsyncSessionDrafter` drives one `npu_draft` session on its own worker thread
(`AsyncDraftSession`). Greedy rounds use two calls:

- `draft(committed, k_max, worth)`: up to k_max tokens after `committed`, one at a
  time, stopping at the first token the rule `worth(position, cumulative_p)` says is
  not worth verifying. Tokens the session already holds beyond `committed` (drafted
  ahead during the previous verification) are reused instead of recomputed.
- `extend(n_max, cancel)`: keep drafting the current line while the server verifies
  it, as if every pending draft is accepted; stops as soon as `cancel` is set. On a
  round where the whole block and the bonus guess are accepted, the next `draft`
  finds those tokens ready.
"""

from __future__ import annotations

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


class AsyncDrafter(Protocol):
    """What the engine needs from a draft session: propose after a committed sequence."""

    async def propose(self, committed: Sequence[int], k: int) -> list[int]: ...

    async def close(self) -> None: ...


class _Line:
    """The session's tokens beyond the last sync and the draft's p for each.

    Lives on the worker thread; only worker-thread functions touch it."""

    def __init__(self) -> None:
        self.base = 0  # length of the sequence last synced
        self.probs: list[float] = []  # p of session.tokens[base:]

    def take(self, session: DraftSession, committed: Sequence[int]) -> list[tuple[int, float]]:
        """Tokens (with p) the session already holds after `committed`, or [] after
        syncing to `committed` when it is not a prefix of the session's line."""
        have = session.tokens
        n = len(committed)
        if self.base <= n <= len(have) and _same(have, committed, self.base):
            offset = n - self.base
            return list(zip(have[n:], self.probs[offset:], strict=True))
        session.sync(committed)
        self.base = len(committed)
        self.probs = []
        return []

    def step(self, session: DraftSession) -> tuple[int, float] | None:
        """Draft one more token on the line; None when the session proposes none."""
        draft = session.propose(1)
        if not draft.tokens:
            return None
        prob = draft.probs[0] if draft.probs else 1.0
        self.probs.append(prob)
        return int(draft.tokens[0]), float(prob)


def _same(have: Sequence[int], committed: Sequence[int], start: int) -> bool:
    """have[:len(committed)] == committed, knowing both share the first `start` tokens
    (the last sync); compares only the rest."""
    n = len(committed)
    if n - start < 64:
        return list(have[start:n]) == list(committed[start:n])
    a = np.asarray(have[start:n], dtype=np.int64)
    b = np.asarray(committed[start:n], dtype=np.int64)
    return bool(np.array_equal(a, b))


class AsyncSessionDrafter:
    """Adapts `npu_draft.async_session.AsyncDraftSession` (one worker thread per
    session, cancellable between tokens) to what the engine calls."""

    def __init__(self, session: DraftSession, name: str = "draft") -> None:
        from npu_draft.async_session import AsyncDraftSession

        self._session = AsyncDraftSession(session, name)
        self._greedy_only = False
        self._line = _Line()

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        draft = await self.draft(committed, k, always)
        return draft.tokens

    async def draft(self, committed: Sequence[int], k_max: int, worth: StopRule) -> GreedyDraft:
        committed = list(committed)

        def work(session: DraftSession) -> GreedyDraft:
            out = GreedyDraft()
            ready = self._line.take(session, committed)
            cumulative = 1.0
            for position in range(1, k_max + 1):
                from_line = position <= len(ready)
                if from_line:
                    token, prob = ready[position - 1]
                else:  # every ready token is used: the line ends where we draft
                    stepped = self._line.step(session)
                    if stepped is None:
                        break
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
        """Draft up to n_max more tokens on the line; returns how many."""

        def work(session: DraftSession) -> int:
            made = 0
            while made < n_max and not cancel.cancelled:
                if self._line.step(session) is None:
                    break
                made += 1
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


__all__ = ["AsyncDrafter", "AsyncSessionDrafter", "GreedyDraft", "StopRule", "always"]
