"""Where a round's draft comes from: drafted now, started early (while the proxy
committed the last round), or drafted ahead (while the server verified).

A failing drafter is dropped and closed: every later round then drafts nothing, which
is plain decoding, lossless either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from npu_draft.protocol import CancelToken, Draft, SamplingParams, SparseDist
from proxy.data.records import RoundObserver
from proxy.engine.drafting import AsyncDrafter, GreedyDraft, StopRule

log = logging.getLogger(__name__)

# a draft, its q in sampling mode, and the ms the round waited for it
DraftOutcome = tuple[GreedyDraft, list[SparseDist | None] | None, float]
Proposal = tuple[GreedyDraft, list[SparseDist | None] | None]


class DraftSource:
    """The drafter's work for one generation."""

    def __init__(
        self,
        drafter: AsyncDrafter | None,
        worth: StopRule,
        request_id: str = "-",
        observer: RoundObserver | None = None,
    ) -> None:
        self.drafter = drafter
        self.worth = worth  # the draft-length policy's stop rule, asked per position
        self.request_id = request_id
        self.observer = observer
        self.failed = False
        self._ahead: asyncio.Task[None] | None = None
        self._ahead_cancel: CancelToken | None = None
        # when the current (or last) drafting ahead started and ended (perf_counter s)
        self._ahead_span: tuple[float, float | None] | None = None
        # the next round's draft, started when the verify result came back: (the
        # committed sequence it drafts after, its length, its fresh length, the task)
        self._early: tuple[list[int], int, int, asyncio.Task[DraftOutcome]] | None = None
        # a draft made only to time the drafter (`start_timing`), while the server
        # decodes alone, and when it ended (perf_counter s)
        self._timing: asyncio.Task[DraftOutcome] | None = None
        self._timing_span: tuple[float, float | None] | None = None

    @property
    def available(self) -> bool:
        return self.drafter is not None

    @property
    def can_draft_ahead(self) -> bool:
        return self.drafter is not None and self.drafter.draft_ahead

    async def draft(self, committed: list[int], k: int, k_fresh: int | None = None) -> DraftOutcome:
        """Greedy: up to k drafts after `committed`, at most `k_fresh` where none was
        drafted ahead."""
        worth = self.worth

        async def propose(drafter: AsyncDrafter) -> Proposal:
            if k_fresh is not None and k_fresh < k:
                return await drafter.draft(committed, k, worth, k_fresh), None
            return await drafter.draft(committed, k, worth), None

        return await self._guarded(k, propose)

    async def draft_sampled(
        self, committed: list[int], k: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> DraftOutcome:
        """Sampling: k tokens drawn from the draft's q, with q where it has one."""

        async def propose(drafter: AsyncDrafter) -> Proposal:
            tokens, dists = await _propose_sampled(drafter, committed, k, sampling, rng)
            return GreedyDraft(tokens=tokens), dists

        return await self._guarded(k, propose)

    async def _guarded(
        self, k: int, propose: Callable[[AsyncDrafter], Awaitable[Proposal]]
    ) -> DraftOutcome:
        """(the draft, its q, ms the round waited for it); an empty draft where there is
        no drafter or it failed."""
        if k <= 0 or self.drafter is None:
            return GreedyDraft(), None, 0.0
        started = time.perf_counter()
        await self.stop_ahead()
        await self._end_timing()
        if self.drafter is None:  # the timing draft failed
            return GreedyDraft(), None, (time.perf_counter() - started) * 1e3
        try:
            draft, dists = await propose(self.drafter)
        except asyncio.CancelledError:
            raise
        except Exception:
            await _close_quietly(self._drop_drafter())
            return GreedyDraft(), None, (time.perf_counter() - started) * 1e3
        draft.tokens, draft.probs = draft.tokens[:k], draft.probs[:k]
        return draft, dists, (time.perf_counter() - started) * 1e3

    def start_early(self, committed: list[int], k: int, k_fresh: int) -> None:
        """Draft the next round now (after `committed`, up to k), while the proxy
        commits this round's tokens; `take` picks it up."""
        if k <= 0 or self.drafter is None or not self.drafter.early_draft:
            return
        task = asyncio.create_task(self.draft(committed, k, k_fresh=k_fresh))
        self._early = (committed, k, k_fresh, task)

    async def take(self, committed: list[int], k: int, k_fresh: int) -> DraftOutcome:
        """The greedy draft of up to k tokens (k_fresh where none was drafted ahead)
        after `committed`: the early draft where it drafted after the same sequence
        (extended where it is shorter), else now. The time returned is what this call
        waited."""
        early, self._early = self._early, None
        if early is None:
            return await self.draft(committed, k, k_fresh=k_fresh)
        early_committed, early_k, early_fresh, task = early
        started = time.perf_counter()
        drafted, dists, _ = await task
        if early_committed != committed or early_k < k or early_fresh < min(k_fresh, k):
            # another sequence (a plain run came between), or a longer draft wanted now:
            # the line keeps what was drafted, so drafting again reuses it
            again, again_dists, again_ms = await self.draft(committed, k, k_fresh=k_fresh)
            if early_committed == committed:
                # of what comes back from the line, only the early draft's own reuse was
                # drafted ahead; the rest it drafted itself, after the verification
                early_own = drafted.fresh  # with a token cut by the stop rule
                again.reused = max(0, again.reused - early_own)
                # where the round's drafts started is what the early draft found
                again.resynced = drafted.resynced
            return again, again_dists, again_ms
        drafted.tokens, drafted.probs = drafted.tokens[:k], drafted.probs[:k]
        return drafted, dists, (time.perf_counter() - started) * 1e3

    def start_timing(self, committed: list[int], k: int, report: Callable[[float], None]) -> None:
        """Draft k tokens after `committed` only to learn the drafter's speed, in the
        background (the server decodes alone meanwhile; the draft session keeps the
        prompt it took in for later rounds). `report` gets its ms per drafted token when
        it is done, also after this generation has ended."""
        if k <= 0 or self.drafter is None or self._timing is not None:
            return
        task = asyncio.create_task(self.draft(committed, k))
        started = time.perf_counter()
        self._timing_span = (started, None)

        def done(task: asyncio.Task[DraftOutcome]) -> None:
            self._timing_span = (started, time.perf_counter())
            if task.cancelled() or task.exception() is not None:
                return
            draft, _dists, waited_ms = task.result()
            if draft.fresh > 0:
                report(draft.fresh_ms / draft.fresh)
            elif draft.tokens:  # a drafter that does not time its own steps
                report(waited_ms / len(draft.tokens))

        task.add_done_callback(done)
        self._timing = task

    def busy_since(self, start: float) -> bool:
        """Whether the drafter did real work in the background after `start`
        (perf_counter s): this generation's timing draft, unless it took too little
        time to matter (a model-free drafter), or a session of an earlier generation
        still closing after its own timing draft."""
        if any(not task.done() for task in _closing):
            return True
        if self._timing_span is None:
            return False
        began, ended = self._timing_span
        if ended is None:
            return time.perf_counter() - began >= _BUSY_MIN_S
        return ended > start and ended - began >= _BUSY_MIN_S

    async def _end_timing(self) -> None:
        """Wait for a running timing draft: one draft at a time on the session."""
        task = self._timing
        if task is not None and asyncio.current_task() is not task:
            self._timing = None
            await asyncio.gather(task, return_exceptions=True)

    def start_ahead(self, n_tokens: Callable[[], int]) -> None:
        """While the server verifies, keep drafting the line as if all is accepted:
        `n_tokens()` more (asked when drafting starts)."""
        drafter = self.drafter
        assert drafter is not None
        self._ahead_cancel = cancel = CancelToken()
        started = time.perf_counter()
        self._ahead_span = (started, None)

        async def run() -> None:
            try:
                await drafter.extend(n_tokens(), cancel)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("[%s] drafting ahead failed", self.request_id, exc_info=True)
            finally:
                self._ahead_span = (started, time.perf_counter())

        self._ahead = asyncio.create_task(run())

    async def stop_ahead(self) -> None:
        """Stop drafting ahead (it ends after the token in progress) and wait for it."""
        if self._ahead is None:
            return
        assert self._ahead_cancel is not None
        self._ahead_cancel.cancel()
        ahead, self._ahead = self._ahead, None
        await asyncio.gather(ahead, return_exceptions=True)

    def busy_ms(self, start: float, end: float) -> float:
        """How long drafting ahead ran within [start, end] (perf_counter seconds)."""
        if self._ahead_span is None:
            return 0.0
        ahead_start, ahead_end = self._ahead_span
        busy = min(end if ahead_end is None else ahead_end, end) - max(ahead_start, start)
        return max(busy, 0.0) * 1e3

    async def close(self) -> None:
        """End the generation's drafting: the early draft, drafting ahead, the session."""
        early, self._early = self._early, None
        if early is not None:
            early[3].cancel()
            await asyncio.gather(early[3], return_exceptions=True)
        await self.stop_ahead()
        timing, self._timing = self._timing, None
        if timing is not None and not timing.done() and self.drafter is not None:
            # the drafter is still taking in the prompt (its worker cannot be cut short):
            # let it finish and report in the background rather than hold the response
            _closing.add(task := asyncio.create_task(_close_after(timing, self.drafter)))
            task.add_done_callback(_closing.discard)
            return
        if self.drafter is not None:
            await _close_quietly(self.drafter)

    def _drop_drafter(self) -> AsyncDrafter | None:
        """Lossless either way: without a draft every round is plain decoding."""
        log.exception("[%s] drafter failed; plain decoding for this request", self.request_id)
        if self.observer is not None:
            self.observer.observe_drafter_failure()
        self.failed = True
        drafter, self.drafter = self.drafter, None
        return drafter


async def _propose_sampled(
    drafter: AsyncDrafter,
    committed: Sequence[int],
    k: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[int], list[SparseDist | None]]:
    """Draft tokens and their q. A drafter without q (`DrafterBase.propose_sampled`)
    gives None: the rule then uses the point mass at each token, which is exact for
    any proposal."""
    draft: Draft = await drafter.propose_sampled(committed, k, sampling, rng)
    tokens = [int(t) for t in draft.tokens][:k]
    dists: list[SparseDist | None] = list(draft.dists or [])[: len(tokens)]
    return tokens, dists + [None] * (len(tokens) - len(dists))


_closing: set[asyncio.Task[None]] = set()  # draft sessions closing after a timing draft
_BUSY_MIN_S = 0.02  # background drafting shorter than this disturbs no plain run


async def _close_after(timing: asyncio.Task[DraftOutcome], drafter: AsyncDrafter) -> None:
    await asyncio.gather(timing, return_exceptions=True)
    await _close_quietly(drafter)


async def _close_quietly(drafter: AsyncDrafter | None) -> None:
    if drafter is None:
        return
    try:
        await drafter.close()
    except Exception:  # closing must never mask the request's own outcome
        log.exception("closing the draft session failed")
