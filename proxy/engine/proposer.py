"""Where a round's draft comes from: the one object the engine asks for drafts.

A `Proposer` serves one generation. The rounds ask it:

- `draft(committed, k)`: this round's draft. Greedy: at the lengths the draft-length
  policy chooses, taken from a prepared draft where one drafted after the same
  sequence, else drafted now. Sampling: k draws from the draft's q.
- `prepare(committed, k)`: the next round's committed sequence is known (the verify
  result is back): draft it now, while the proxy commits this round (greedy, with early
  drafts on).
- `draft_ahead(n_drafted)`: while the server verifies, keep drafting the line as if
  every draft is accepted, where the overlap policy says, then (`runner_up_lines`) the
  lines after the draft's runner-ups at the likeliest misses, while the verify time
  measured so far leaves room; `stop_ahead` ends it.
- `time_drafter(committed, k, report)`: while the server decodes alone, draft only to
  learn the drafter's speed.

Every call on the drafter goes through `_guarded`, once: the guard's time bound and id
check where the proxy gave a guard (`DraftGuard`, the drafter supervisor), which
counts a failure. A draft that fails (`_run_draft`) drops the drafter, so the rest of
the generation is plain decoding, lossless either way; drafting ahead that fails is
logged, and the next draft goes on with what the line holds.

Multi-outcome drafting (issue 29): `draft` after a miss takes the runner-up line
drafted ahead where the committed sequence ends on that runner-up
(`proxy.engine.drafting.RunnerUpLines`), else drafts fresh as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from npu_draft.protocol import CancelToken, Draft, SamplingParams, SparseDist
from proxy.data.records import RoundObserver
from proxy.engine.acceptance import Dists
from proxy.engine.background import BackgroundTasks
from proxy.engine.drafting import AsyncDrafter, GreedyDraft, RunnerUpLines
from proxy.policies import Policies

log = logging.getLogger(__name__)

T = TypeVar("T")
# a draft, its q in sampling mode, and the ms the round waited for it
DraftOutcome = tuple[GreedyDraft, Dists, float]
_BUSY_MIN_S = 0.02  # background drafting shorter than this disturbs no plain run
# runner-up lines end by this share of the verify time measured so far (a line still
# drafting when the result is back delays the next draft by its step)
_LINES_SHARE = 0.85
_VERIFY_WEIGHT = 0.3  # the moving average's weight of the newest verification


class DraftGuard(Protocol):
    """The proxy's bounds on its draft sessions and where their faults are counted
    (`proxy.drafter_guard.DrafterSupervisor`)."""

    async def bounded(self, call: Awaitable[T], k: int, tokens_of: Callable[[T], list[int]]) -> T:
        """`call`'s answer within the time bound, its token ids checked; a failure is
        counted and raised."""
        ...

    def session_closed(self) -> None:
        """A session it opened is closed."""
        ...


@dataclass(frozen=True)
class SampledDrafts:
    """Sampling mode: the chain the drafter mirrors and the request's draft stream."""

    chain: SamplingParams
    rng: np.random.Generator


@dataclass
class _Prepared:
    """A draft started before its round: after `committed`, at most k (k_fresh fresh)."""

    committed: list[int]
    k: int
    k_fresh: int
    task: asyncio.Task[DraftOutcome]


class Proposer:
    """The drafter's work for one generation; see the module's docstring."""

    def __init__(
        self,
        drafter: AsyncDrafter | None,
        policies: Policies,
        early_draft: bool = True,
        sampled: SampledDrafts | None = None,
        guard: DraftGuard | None = None,
        background: BackgroundTasks | None = None,
        request_id: str = "-",
        observer: RoundObserver | None = None,
        runner_up_lines: bool = True,
    ) -> None:
        self.drafter = drafter
        self.runner_up_lines = runner_up_lines
        self.policies = policies
        self.early_draft = early_draft
        self.sampled = sampled
        self.guard = guard
        self.background = background if background is not None else BackgroundTasks()
        self.request_id = request_id
        self.observer = observer
        self.failed = False
        self._prepared: _Prepared | None = None
        self._ahead: asyncio.Task[None] | None = None
        self._ahead_cancel: CancelToken | None = None
        # when the current (or last) drafting ahead started and ended (perf_counter s)
        self._ahead_span: tuple[float, float | None] | None = None
        # the moving average of a verification's wall time (drafting ahead's start to
        # its stop), which bounds the runner-up lines
        self._verify_s: float | None = None
        # a draft made only to time the drafter, and when it ran (perf_counter s)
        self._timing: asyncio.Task[DraftOutcome] | None = None
        self._timing_span: tuple[float, float | None] | None = None

    @property
    def available(self) -> bool:
        return self.drafter is not None

    @property
    def can_draft_ahead(self) -> bool:
        return self.drafter is not None and self.drafter.draft_ahead

    # -- what the rounds ask -----------------------------------------------------------

    async def draft(self, committed: list[int], k: int, upcoming: int = 0) -> DraftOutcome:
        """This round's draft of at most k tokens after `committed`, and the ms the
        round waited for it; an empty draft where there is no drafter or it failed.
        `upcoming` 1: the round is sent ahead, before the last one is observed."""
        if self.sampled is not None:
            return await self._draft_sampled(committed, k, self.sampled)
        k, k_fresh = self._lengths(k, upcoming)
        return await self._take_prepared(committed, k, k_fresh)

    def has_prepared(self) -> bool:
        """A draft for the next round was started (`prepare`)."""
        return self._prepared is not None

    async def prepare(self, committed: list[int], k: int) -> None:
        """The next round's committed sequence is known: its draft of at most k may
        start (wasted only where the generation stops). It gets one turn of the event
        loop to reach the drafter's thread, which then takes the line drafted ahead
        while the proxy commits this round. Left to start when the next round asked
        for it, a draft that was ready still cost that round a median 0.59 ms on the
        2-core machine (Strix Halo 14B emulated), 0.25 ms now."""
        if self.sampled is not None or not self.early_draft:
            return  # each sampling round draws its draft afresh
        k, k_fresh = self._lengths(k, upcoming=1)
        if k <= 0 or self.drafter is None or not self.drafter.early_draft:
            return
        task = asyncio.create_task(self._draft_greedy(committed, k, k_fresh))
        self._prepared = _Prepared(committed, k, k_fresh, task)
        await asyncio.sleep(0)

    def draft_ahead(self, n_drafted: int, upcoming: int = 0) -> bool | None:
        """While the server verifies the round's `n_drafted` drafts: draft ahead, as the
        overlap policy chooses (None: no choice made). `upcoming` 1: the round was sent
        ahead, before the last one is observed."""
        if self.sampled is not None or not n_drafted:
            return None  # a sampled line is not a greedy line to extend
        chosen = self.policies.overlap.decide(self.can_draft_ahead)
        if chosen:  # the bonus guess and the next round's drafts
            draft_length = self.policies.draft_length
            # the next round's index, counted now: the plan runs when drafting starts,
            # which may come after the last round is observed
            after = draft_length.rounds + 1 + upcoming

            def plan() -> tuple[int, RunnerUpLines | None]:
                next_k = draft_length.decide_at(True, after)[0]
                return next_k + 1, self._lines(n_drafted, next_k)

            self._start_ahead(plan)
        return chosen

    def _lines(self, n_drafted: int, next_k: int) -> RunnerUpLines | None:
        """The runner-up lines a verification of `n_drafted` drafts leaves room for."""
        if not self.runner_up_lines or self._verify_s is None or next_k <= 0:
            return None
        until = time.perf_counter() + _LINES_SHARE * self._verify_s
        return RunnerUpLines(pending=n_drafted, length=next_k, most=n_drafted + 1, until=until)

    async def stop_ahead(self) -> None:
        """Stop drafting ahead (it ends after the token in progress) and wait for it."""
        if self._ahead is None:
            return
        assert self._ahead_cancel is not None
        self._ahead_cancel.cancel()
        if self._ahead_span is not None:  # the verification it ran beside is back
            took = time.perf_counter() - self._ahead_span[0]
            old = self._verify_s
            self._verify_s = took if old is None else old + _VERIFY_WEIGHT * (took - old)
        ahead, self._ahead = self._ahead, None
        if ahead.done():  # no turn of the event loop for what has already finished
            if not ahead.cancelled():
                ahead.exception()  # retrieved, as gather would: its failure is not ours
            return
        await asyncio.gather(ahead, return_exceptions=True)

    def time_drafter(self, committed: list[int], k: int, report: Callable[[float], None]) -> None:
        """Draft k tokens after `committed` only to learn the drafter's speed, in the
        background (the server decodes alone meanwhile; the draft session keeps the
        prompt it took in for later rounds). `report` gets its ms per drafted token when
        it is done, also after this generation has ended."""
        if k <= 0 or self.drafter is None or self._timing is not None:
            return
        task = self._draft_beside(committed, k)

        def done(task: asyncio.Task[DraftOutcome]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            draft, _dists, waited_ms = task.result()
            if draft.fresh > 0:
                report(draft.fresh_ms / draft.fresh)
            elif draft.tokens:  # a drafter that does not time its own steps
                report(waited_ms / len(draft.tokens))

        task.add_done_callback(done)

    def shadow_draft(self, committed: list[int], k: int) -> asyncio.Task[DraftOutcome] | None:
        """A greedy draft of at most k tokens after `committed`, in the background
        beside a plain run, to be checked against the run's tokens (the plain-run gate's
        shadow checks); None where none can start: no drafter, a sampling request, or a
        draft still running (one draft at a time on the session)."""
        if k <= 0 or self.drafter is None or self.sampled is not None:
            return None
        if self._timing is not None and not self._timing.done():
            return None
        if self._prepared is not None and not self._prepared.task.done():
            return None
        return self._draft_beside(committed, k)

    def _draft_beside(self, committed: list[int], k: int) -> asyncio.Task[DraftOutcome]:
        """Draft in the background while the server decodes alone; the next draft of
        this generation waits for it (`_end_timing`), and `busy_since` sees it."""
        task = asyncio.create_task(self._draft_greedy(committed, k))
        started = time.perf_counter()
        self._timing_span = (started, None)

        def ended(_task: asyncio.Task[DraftOutcome]) -> None:
            self._timing_span = (started, time.perf_counter())

        task.add_done_callback(ended)
        self._timing = task
        return task

    def busy_since(self, start: float) -> bool:
        """Whether the drafter did real work in the background after `start`
        (perf_counter s): this generation's timing draft, unless it took too little
        time to matter (a model-free drafter), or a session of an earlier generation
        still closing after its own timing draft."""
        if self.background.drafter_busy():
            return True
        if self._timing_span is None:
            return False
        began, ended = self._timing_span
        if ended is None:
            return time.perf_counter() - began >= _BUSY_MIN_S
        return ended > start and ended - began >= _BUSY_MIN_S

    def busy_ms(self, start: float, end: float) -> float:
        """How long drafting ahead ran within [start, end] (perf_counter seconds)."""
        if self._ahead_span is None:
            return 0.0
        ahead_start, ahead_end = self._ahead_span
        busy = min(end if ahead_end is None else ahead_end, end) - max(ahead_start, start)
        return max(busy, 0.0) * 1e3

    async def close(self) -> None:
        """End the generation's drafting: the prepared draft, drafting ahead, the
        session (once)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.task.cancel()
            await asyncio.gather(prepared.task, return_exceptions=True)
        await self.stop_ahead()
        timing, self._timing = self._timing, None
        drafter, self.drafter = self.drafter, None
        if drafter is None:
            return
        if timing is not None and not timing.done():
            # the drafter is still taking in the prompt (its worker cannot be cut short):
            # let it finish and report in the background rather than hold the response
            self.background.start(self._close_after(timing, drafter), uses_drafter=True)
            return
        await self._close_drafter(drafter)

    # -- greedy lengths and prepared drafts --------------------------------------------

    def _lengths(self, k: int, upcoming: int = 0) -> tuple[int, int]:
        """(most drafts, most drafted fresh) for a round allowed k, as the draft-length
        policy chooses for rounds that draft ahead as things stand or not (`upcoming`
        1: for the round after the one in progress)."""
        ahead = self.can_draft_ahead and self.policies.overlap.expects_ahead()
        most, fresh = self.policies.draft_length.decide(ahead, upcoming)
        k = min(k, most)
        return k, min(k, fresh)

    async def _take_prepared(self, committed: list[int], k: int, k_fresh: int) -> DraftOutcome:
        """The greedy draft of up to k tokens (k_fresh where none was drafted ahead)
        after `committed`: the prepared draft where it drafted after the same sequence
        (extended where it is shorter), else now. The time returned is what this call
        waited."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return await self._draft_greedy(committed, k, k_fresh)
        started = time.perf_counter()
        drafted, dists, _ = await prepared.task
        same = prepared.committed == committed
        if not same or prepared.k < k or prepared.k_fresh < min(k_fresh, k):
            # another sequence (a plain run came between), or a longer draft wanted now:
            # the line keeps what was drafted, so drafting again reuses it
            again, again_dists, again_ms = await self._draft_greedy(committed, k, k_fresh)
            if same:
                # of what comes back from the line, only the prepared draft's own reuse
                # was drafted ahead; the rest it drafted itself, after the verification
                early_own = drafted.fresh  # with a token cut by the stop rule
                again.reused = max(0, again.reused - early_own)
                # where the round's drafts started is what the prepared draft found
                again.resynced = drafted.resynced
            return again, again_dists, again_ms
        drafted.tokens, drafted.probs = drafted.tokens[:k], drafted.probs[:k]
        return drafted, dists, (time.perf_counter() - started) * 1e3

    def _start_ahead(self, plan: Callable[[], tuple[int, RunnerUpLines | None]]) -> None:
        """Keep drafting the line as if all is accepted, then the runner-up lines:
        `plan()` says how many tokens and which lines (asked when drafting starts)."""
        drafter = self.drafter
        assert drafter is not None
        self._ahead_cancel = cancel = CancelToken()
        started = time.perf_counter()
        self._ahead_span = (started, None)

        async def run() -> None:
            try:
                n_max, lines = plan()
                if lines is None:  # a drafter may offer no lines (`DrafterBase`)
                    call = drafter.extend(n_max, cancel)
                else:
                    call = drafter.extend(n_max, cancel, lines)
                await self._guarded(call, n_max, lambda _made: [])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("[%s] drafting ahead failed", self.request_id, exc_info=True)
            finally:
                self._ahead_span = (started, time.perf_counter())

        self._ahead = asyncio.create_task(run())

    # -- the drafter's calls, bounded once ---------------------------------------------

    async def _draft_greedy(
        self, committed: list[int], k: int, k_fresh: int | None = None
    ) -> DraftOutcome:
        """Greedy: up to k drafts after `committed` (at most `k_fresh` where none was
        drafted ahead), stopping where the draft-length policy's rule says."""
        worth = self.policies.draft_length.worth

        def call(drafter: AsyncDrafter) -> Awaitable[GreedyDraft]:
            if k_fresh is not None and k_fresh < k:
                return drafter.draft(committed, k, worth, k_fresh)
            return drafter.draft(committed, k, worth)

        async def propose(drafter: AsyncDrafter) -> tuple[GreedyDraft, Dists]:
            return await self._guarded(call(drafter), k, lambda d: d.tokens), None

        return await self._run_draft(k, propose)

    async def _draft_sampled(
        self, committed: list[int], k: int, sampled: SampledDrafts
    ) -> DraftOutcome:
        """Sampling: k tokens drawn from the draft's q, with q where it has one. A
        drafter without q (`DrafterBase.draft_sampled`) gives None per token: the rule
        then uses the point mass at each token, which is exact for any proposal."""

        async def propose(drafter: AsyncDrafter) -> tuple[GreedyDraft, Dists]:
            call = drafter.draft_sampled(committed, k, sampled.chain, sampled.rng)
            draft: Draft = await self._guarded(call, k, lambda d: d.tokens)
            tokens = [int(t) for t in draft.tokens][:k]
            dists: list[SparseDist | None] = list(draft.dists or [])[: len(tokens)]
            return GreedyDraft(tokens=tokens), dists + [None] * (len(tokens) - len(dists))

        return await self._run_draft(k, propose)

    async def _run_draft(
        self, k: int, propose: Callable[[AsyncDrafter], Awaitable[tuple[GreedyDraft, Dists]]]
    ) -> DraftOutcome:
        """One draft at a time on the session (drafting ahead and a timing draft end
        first); (the draft cut to k, its q, ms the round waited for it), or an empty
        draft where there is no drafter or it failed (it is then dropped)."""
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
            await self._drop_drafter()
            return GreedyDraft(), None, (time.perf_counter() - started) * 1e3
        draft.tokens, draft.probs = draft.tokens[:k], draft.probs[:k]
        return draft, dists, (time.perf_counter() - started) * 1e3

    async def _guarded(self, call: Awaitable[T], k: int, tokens_of: Callable[[T], list[int]]) -> T:
        """The guard's time bound and id check, where the proxy gave a guard."""
        if self.guard is None:
            return await call
        return await self.guard.bounded(call, k, tokens_of)

    async def _end_timing(self) -> None:
        """Wait for a running timing draft: one draft at a time on the session."""
        task = self._timing
        if task is not None and asyncio.current_task() is not task:
            self._timing = None
            await asyncio.gather(task, return_exceptions=True)

    async def _drop_drafter(self) -> None:
        """Lossless either way: without a draft every round is plain decoding."""
        log.exception("[%s] drafter failed; plain decoding for this request", self.request_id)
        if self.observer is not None:
            self.observer.observe_drafter_failure()
        self.failed = True
        drafter, self.drafter = self.drafter, None
        if drafter is not None:
            await self._close_drafter(drafter)

    async def _close_after(self, timing: asyncio.Task[DraftOutcome], drafter: AsyncDrafter) -> None:
        await asyncio.gather(timing, return_exceptions=True)
        await self._close_drafter(drafter)

    async def _close_drafter(self, drafter: AsyncDrafter) -> None:
        try:
            await drafter.close()
        except Exception:  # closing must never mask the request's own outcome
            log.exception("closing the draft session failed")
        finally:
            if self.guard is not None:
                self.guard.session_closed()


__all__ = ["DraftGuard", "DraftOutcome", "Proposer", "SampledDrafts"]
