"""The rounds of one generation: a plain run, or a speculative round built from named
steps, draft -> verify -> accept -> commit -> record."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace

from npu_draft.protocol import common_prefix_length
from proxy.data.records import RoundObserver, RoundRecord
from proxy.data.verify import PlainRun, VerifyResult
from proxy.engine.acceptance import Acceptance, Dists, SampledAcceptance
from proxy.engine.background import BackgroundTasks
from proxy.engine.decode_check import DecodeCounter
from proxy.engine.drafting import GreedyDraft
from proxy.engine.loop_state import LoopState
from proxy.engine.proposer import DraftOutcome, Proposer
from proxy.engine.round_shape import RoundShape, filler_tokens
from proxy.engine.rules import Rule
from proxy.engine.server_text import PieceCache, TokenEvent
from proxy.engine.slot_copies import CopyTimes, FirstRound, SlotCopies
from proxy.policies import Policies
from proxy.server.upstream import UpstreamClient

ROUND_LOG = "proxy.engine.rounds.log"  # `--log-rounds` sets it to DEBUG
round_log = logging.getLogger(ROUND_LOG)


@dataclass
class _Round:
    """What one speculative round carries from step to step (perf_counter s)."""

    started: float
    committed: list[int]
    room: int  # tokens the server may still produce
    plan: FirstRound
    k: int = 0  # the most drafts it may verify
    drafted: GreedyDraft = field(default_factory=GreedyDraft)
    dists: Dists = None
    draft_ms: float = 0.0
    draft_ready: float = 0.0
    verify_start: float = 0.0  # after the slot copies the round needed, if any
    verify_back: float = 0.0
    drafted_ahead: bool | None = None
    drafter_idle_ms: float = 0.0
    results: list[VerifyResult] = field(default_factory=list)
    # one more prompt that pads the batch to the length's one shape, and its result
    pad: list[int] = field(default_factory=list)
    pad_result: VerifyResult | None = None
    pad_chosen: bool | None = None  # padded or not by choice; None: it could not be
    acceptance: Acceptance = field(default_factory=lambda: Acceptance(0, [], 0))
    n_committed: int = 0
    copied: bool = False  # slots were copied for it (its times are no steady round's)
    refreshed: bool = False  # ... fresh into a slot it used: its verify time is steady
    # its other slots catch up inside its batch: after plain runs, or the round after a
    # first round (on a new turn of a conversation they ingest its new tokens there,
    # too few to copy, which on Strix Halo's Vulkan crosses the 8-token edge)
    lagged: bool = False
    # sent ahead: its verification, sent while the proxy still committed the last round
    verify_task: asyncio.Task[list[VerifyResult]] | None = None
    # the round sent ahead after this one (its draft judges this round's choice to
    # draft ahead; it starts where this one ends)
    next: _Round | None = None

    @property
    def verify_ms(self) -> float:
        return (self.verify_back - self.verify_start) * 1e3


class Rounds:
    """One generation's rounds and what they use: the server, the rule, the proposer,
    the policies, slot copies and the decode check."""

    def __init__(
        self,
        upstream: UpstreamClient,
        prompt: list[int],
        pieces: PieceCache,
        k_max: int,
        rule: Rule,
        proposer: Proposer,
        policies: Policies,
        slots: SlotCopies,
        decodes: DecodeCounter,
        observer: RoundObserver | None,
        background: BackgroundTasks,
        send_ahead: bool = True,
        pad_rounds: bool = False,  # may pad: the padding policy chooses round by round
    ) -> None:
        self.upstream = upstream
        self.prompt = prompt
        self.pieces = pieces
        self.k_max = k_max
        self.rule = rule
        self.proposer = proposer
        self.policies = policies
        self.slots = slots
        self.decodes = decodes
        self.observer = observer
        self.background = background
        self.send_ahead = send_ahead
        self._ahead: _Round | None = None  # the round sent ahead, not yet taken up
        self.shape = RoundShape(filler_tokens(prompt)) if pad_rounds else None
        # the last verify round's drafts and how many were accepted (None after a plain
        # run): a round of as many drafts ingests what `round_shape` predicts
        self._last_drafts: tuple[int, int] | None = None

    def plain_run_length(self, loop: LoopState) -> int:
        """Tokens the server should decode alone next (0: a speculative round); never
        in the first round, which prefills the slots, nor where the next round was sent
        ahead."""
        if not loop.rounds or not self.proposer.available or self._ahead is not None:
            return 0
        return max(0, min(self.policies.plain_run_tokens(), loop.text.remaining()))

    # -- a plain run -----------------------------------------------------------------

    async def plain_run(self, loop: LoopState, n: int, started: float) -> AsyncIterator[TokenEvent]:
        """The server decodes up to n tokens alone, in one request."""
        loop.awaiting_overlap = None
        self._last_drafts = None
        await self.proposer.stop_ahead()  # its line would be stale after the run
        context = self.prompt + loop.text.tokens
        shadow = None
        timing = self.policies.wants_drafter_speed()
        if timing:
            # the drafter is idle while the server decodes alone: time it now
            self.proposer.time_drafter(context, self.k_max, self.policies.observe_drafter_speed)
        elif self.policies.wants_shadow_draft():
            # at the length the rounds would draft: what a round would have accepted
            ahead = self.proposer.can_draft_ahead
            k = min(self.k_max, n, self.policies.draft_length.length(ahead))
            shadow = self.proposer.shadow_draft(context, k)
        sent = time.perf_counter()
        run = await self.rule.plain_run(self.upstream, context, n)
        back = time.perf_counter()
        if shadow is not None:
            self._check_shadow(shadow, run.tokens)
        run_ms = (back - sent) * 1e3
        events = await self._run_events(loop, run)
        overhead_ms = (time.perf_counter() - sent) * 1e3 - run_ms
        drafter_busy = self.proposer.busy_since(sent)
        server_idle_ms = (sent - loop.last_back) * 1e3
        loop.last_back = back
        loop.lag += len(run.tokens)
        # the run's last token is committed, not yet decoded into its slot
        held = len(context) + len(run.tokens) - 1
        self.slots.used([run.id_slot], run.id_slot, {run.id_slot: held})
        for event in events:
            yield event
        decodes, prompt_tokens = await self.decodes.round_delta()
        record = RoundRecord(
            n_drafted=0,
            n_accepted=0,
            n_committed=len(events),
            draft_ms=0.0,
            verify_ms=run_ms,
            overhead_ms=overhead_ms,
            decodes=decodes,
            prompt_tokens=prompt_tokens,
            plain_run=True,
            draft_ready_ms=(sent - started) * 1e3,
            verify_sent_ms=(sent - started) * 1e3,
            verify_back_ms=(back - started) * 1e3,
            server_idle_ms=server_idle_ms,
            drafter_idle_ms=run_ms,
            round_ms=(time.perf_counter() - started) * 1e3,
            n_run_tokens=len(run.tokens),
            drafter_busy=drafter_busy,
            server_ms=run.server_ms,
        )
        if round_log.isEnabledFor(logging.DEBUG):
            beside = "timing" if timing else "shadow" if shadow is not None else None
            line = _run_line(len(loop.rounds), len(context), run, record, beside)
            round_log.debug("run %s", line)
        self._close_round(loop, record)
        loop.after_run = True

    def _check_shadow(self, shadow: asyncio.Task[DraftOutcome], tokens: list[int]) -> None:
        """A draft made beside a plain run, against the run's tokens: how many of its
        first tokens a round would have accepted (greedy: equal to the server's own),
        and whether one then differed. Judged when the draft is done: the run's tokens
        are not held for it (a drafter's first draft of a request takes in the whole
        context first)."""
        window = self.policies.shadow_window()

        def judge(task: asyncio.Task[DraftOutcome]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            drafted = task.result()[0].tokens
            judged = min(len(drafted), len(tokens))
            if judged:
                accepted = common_prefix_length(drafted, tokens)
                self.policies.observe_shadow_draft(accepted, accepted < judged, window)

        shadow.add_done_callback(judge)

    async def _run_events(self, loop: LoopState, run: PlainRun) -> list[TokenEvent]:
        """The run's tokens through the server-text mirror, up to where the text ends."""
        pieces = await self.pieces.run_pieces(run.tokens, run.content)
        last = len(run.tokens) - 1
        if run.stop_type == "eos":
            pieces[last] = b""  # the server writes no text for the EOG token
        events: list[TokenEvent] = []
        for i, (token, piece) in enumerate(zip(run.tokens, pieces, strict=True)):
            events.append(loop.text.push(token, piece, i == last and run.stop_type == "eos"))
            if loop.text.finished:
                break
        return events

    # -- a speculative round ---------------------------------------------------------

    async def speculative_round(self, loop: LoopState, started: float) -> AsyncIterator[TokenEvent]:
        """draft -> verify -> accept -> commit -> record; the next round's draft may
        start as soon as this one's accepted tokens are known."""
        round_, self._ahead = self._ahead, None
        if round_ is None:
            round_ = await self._prepare(loop, started)
            await self._draft(loop, round_)
        await self._verify(loop, round_)
        round_.acceptance = self.rule.accept(round_.drafted.tokens, round_.dists, round_.results)
        # the prompt that ends at the last accepted draft: its slot holds the most
        n_accepted = round_.acceptance.n_accepted
        self._last_drafts = (len(round_.drafted.tokens), n_accepted)
        fullest = round_.results[n_accepted].id_slot
        # prompt i ended at draft i: its slot holds the committed prefix up to there
        holds = {
            r.id_slot: len(round_.committed) + min(i, n_accepted)
            for i, r in enumerate(round_.results)
        }  # fmt: skip
        self.slots.used(holds.keys(), fullest, holds)
        # the next round's committed sequence is known: its draft may start now (not
        # after a round that filled one slot: plain runs come next)
        n_next = len(round_.acceptance.tokens)
        self._empty_stale(holds.keys(), len(round_.committed) + n_next)
        if not round_.plan.one_slot:
            await self.proposer.prepare(
                round_.committed + round_.acceptance.tokens,
                min(self.k_max, round_.room - n_next - 1),
            )
        events = await self._commit(loop, round_)
        if self._may_send_ahead(loop, round_):
            await self._send_ahead(loop, round_)
        for event in events:
            yield event
        # a first round's slot copies come after its token is out (not in the TTFT)
        await self._after_commit(loop, round_)
        await self._record(loop, round_)

    def _may_send_ahead(self, loop: LoopState, round_: _Round) -> bool:
        """Whether the next round may be drafted and sent before this one is streamed
        and recorded: after a steady greedy round whose next draft was prepared, with
        the text going on and no plain run due (decided before this round is observed:
        the policies lag one round behind there). Not after a first round (its token
        goes out first), nor after one whose slots caught up or were copied for it: the
        draft-length policy does not count those, so the next round's index would be off
        by one. Not with the one-decode check, whose reading would span two rounds."""
        return (
            self.send_ahead
            and bool(loop.rounds)
            and bool(round_.drafted.tokens)
            and not (round_.lagged or round_.copied)
            and not loop.text.finished
            and not self.rule.sampled
            and not self.decodes.enabled
            and self.proposer.has_prepared()
            and not self.policies.prefers_plain()
            and self.plain_run_length(loop) == 0
        )

    async def _send_ahead(self, loop: LoopState, round_: _Round) -> None:
        """The next round's front half now, behind the proxy's own work on this one
        (streaming its tokens, its record and what the policies learn from it), which
        then overlaps the server's verification instead of delaying it. On the Strix Halo
        14B (emulated) that work took ~0.35 ms of the ~0.8 ms between a verify result and
        the next verify request."""
        ahead = await self._prepare(loop, time.perf_counter(), upcoming=1)
        await self._draft(loop, ahead, upcoming=1)
        task = asyncio.create_task(
            self.rule.verify(self.upstream, ahead.committed, ahead.drafted.tokens, ahead.pad)
        )

        def back(_task: asyncio.Task[list[VerifyResult]]) -> None:
            # when the result came, not when this round's tail let it be taken up
            ahead.verify_back = time.perf_counter()

        task.add_done_callback(back)
        ahead.verify_task, self._ahead = task, ahead  # `abandon` sees it from now on
        round_.next = ahead
        await asyncio.sleep(0)  # the request goes out now, not at the consumer's next wait

    async def abandon(self) -> None:
        """The generation ends (or its client left): a round sent ahead is dropped (the
        server may still run its batch; only the slots' contents change)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.verify_task is not None:
            ahead.verify_task.cancel()
            await asyncio.gather(ahead.verify_task, return_exceptions=True)

    def _empty_stale(self, in_use: Collection[int], n_context: int) -> None:
        """Erase, in the background, the slots this generation left behind for good
        (`SlotCopies.stale`), while it has the server to itself: a slot shared with
        another stream may hold that stream's prompt by now."""
        if not self.policies.alone():
            return
        stale = self.slots.stale(in_use, n_context)
        if stale:
            self.slots.erasing = self.background.start(self.slots.empty(stale, self.slots.erasing))

    async def _prepare(self, loop: LoopState, started: float, upcoming: int = 0) -> _Round:
        """Slot copies owed from plain runs, and how many drafts the round may verify:
        never past what the server may still produce (the last prompt of the batch must
        stay below the slot's context; the round commits at most k+1 tokens), none in a
        first round that prefills one slot. `upcoming` 1: sent ahead, before the last
        round is observed."""
        # the round after the first (a round sent ahead never is: none follows a first)
        lagged = loop.after_run or (not upcoming and len(loop.rounds) == 1)
        if loop.after_run:
            # speculation again after plain runs: copy the slot that holds the context
            # into the slots the rounds use, instead of letting each of them prefill what
            # it lags by inside the next verify batch
            await self.slots.catch_up(loop.lag, len(self.prompt) + len(loop.text.tokens))
        loop.after_run = False
        loop.lag = 0
        first = not loop.rounds and self.proposer.available
        one_slot = self.policies.prefers_plain() or self.policies.measuring_first()
        plan = self.slots.first_round(one_slot) if first else FirstRound()
        room = loop.text.remaining()
        round_ = _Round(started, self.prompt + loop.text.tokens, room, plan, lagged=lagged)
        round_.k = max(0, min(self.policies.k_cap(self.k_max), room - 1)) if plan.drafts else 0
        return round_

    async def _draft(self, loop: LoopState, round_: _Round, upcoming: int = 0) -> None:
        """The round's draft; then, while the server verifies it, maybe drafting ahead
        (`upcoming` 1: sent ahead, before the last round is observed)."""
        round_.drafted, round_.dists, round_.draft_ms = await self.proposer.draft(
            round_.committed, round_.k, upcoming
        )
        n_drafted = len(round_.drafted.tokens)
        round_.draft_ready = time.perf_counter()
        warmed = await self.slots.warm_for(n_drafted + 1, len(round_.committed))
        round_.copied, round_.refreshed = bool(warmed), warmed == "refreshed"
        round_.pad = self._pad(round_, n_drafted)
        round_.verify_start = time.perf_counter()
        if loop.awaiting_overlap is not None:  # the last round's choice, judged
            awaiting, loop.awaiting_overlap = loop.awaiting_overlap, None
            assert loop.rounds[-1] is awaiting  # a plain run in between clears it
            # the record completed by what this round's draft waited (a new record:
            # the one the policies and metrics saw is never changed)
            judged = replace(awaiting, next_drafted=n_drafted, next_draft_ms=round_.draft_ms)
            loop.rounds[-1] = judged
            self.policies.observe_next_draft(judged)
        round_.drafted_ahead = self.proposer.draft_ahead(n_drafted, upcoming)

    def _pad(self, round_: _Round, n_drafted: int) -> list[int]:
        """The pad prompt of a round of `n_drafted` drafts after one of as many (none
        where slots were copied for it, which changes what its prompts ingest, or where
        the server has no slot to spare for it; and none where the padding policy
        chooses none)."""
        last = self._last_drafts
        if (
            self.shape is None or not n_drafted or round_.copied or last is None
            or last[0] != n_drafted or not self.policies.spare_slots(n_drafted + 2)
        ):  # fmt: skip
            return []
        round_.pad_chosen = self.policies.padding.decide(n_drafted)
        return self.shape.pad(n_drafted, last[1]) if round_.pad_chosen else []

    def _pad_slot(self, id_slot: int) -> None:
        """The pad prompt took `id_slot`: no slot copy goes there from now on (a slot
        the generation had used and the pad prompt took holds nothing of it now)."""
        assert self.shape is not None
        if id_slot >= 0 and id_slot != self.shape.slot:
            self.shape.slot = id_slot
            self.slots.reserve(id_slot)

    async def _verify(self, loop: LoopState, round_: _Round) -> None:
        """One batch of k+1 prompts: the target's token after each draft prefix (sent
        already where the round was sent ahead)."""
        if round_.verify_task is not None:
            results = await round_.verify_task  # its callback set `verify_back`
        else:
            results = await self.rule.verify(
                self.upstream, round_.committed, round_.drafted.tokens, round_.pad
            )
            round_.verify_back = time.perf_counter()
        if round_.pad:
            *results, round_.pad_result = results
            self._pad_slot(round_.pad_result.id_slot)
        round_.results = results
        round_.drafter_idle_ms = round_.verify_ms
        if round_.drafted_ahead:
            round_.drafter_idle_ms -= self.proposer.busy_ms(round_.verify_start, round_.verify_back)
        if loop.first_round_end is None:
            loop.n_cached = round_.results[0].cached

    async def _commit(self, loop: LoopState, round_: _Round) -> list[TokenEvent]:
        """Push the accepted tokens through the server-text mirror: their events, up to
        where the text ends."""
        events: list[TokenEvent] = []
        for position, token in enumerate(round_.acceptance.tokens):
            piece, is_eog = await self.rule.piece(round_.results[position], token)
            events.append(loop.text.push(token, piece, is_eog))
            if loop.text.finished:
                break
        round_.n_committed = len(events)
        return events

    async def _after_commit(self, loop: LoopState, round_: _Round) -> None:
        """A first round's slot copies, and the slot the other slots lag behind."""
        first = round_.results[0]
        if round_.plan.replicate or round_.plan.one_slot:
            self.slots.observe_first_round(first.server_ms, first.prompt_n)
        if round_.plan.replicate and not loop.text.finished:
            await self.slots.after_first_round(first.id_slot, first.cached)
        if loop.first_round_end is None:
            loop.first_round_end = time.perf_counter()
        if round_.plan.one_slot:
            loop.lag = len(self.prompt) - first.cached

    async def _record(self, loop: LoopState, round_: _Round) -> None:
        """The round's record, checked (one server decode) and observed."""
        decodes, prompt_tokens = await self.decodes.round_delta()
        # a round whose slots caught up is no steady round: the gate took such rounds
        # for speculation speed and chose plain runs
        slots_lagged = round_.lagged
        self.decodes.check(decodes, len(loop.rounds), catch_up=slots_lagged or round_.copied)
        # a round ends where the next one, sent ahead, started: its own tail overlapped
        # that one's verification
        after = round_.next
        ended = after.started if after is not None else time.perf_counter()
        total_ms = (ended - round_.started) * 1e3
        drafted, acceptance = round_.drafted, round_.acceptance
        record = RoundRecord(
            n_drafted=len(drafted.tokens),
            n_accepted=acceptance.n_accepted,
            n_committed=round_.n_committed,
            draft_ms=round_.draft_ms,
            verify_ms=round_.verify_ms,
            overhead_ms=max(total_ms - round_.draft_ms - round_.verify_ms, 0.0),
            decodes=decodes,
            prompt_tokens=prompt_tokens,
            first=not loop.rounds,
            n_matched=acceptance.n_matched if isinstance(acceptance, SampledAcceptance) else None,
            n_reused=drafted.reused,
            draft_ready_ms=(round_.draft_ready - round_.started) * 1e3,
            verify_sent_ms=(round_.verify_start - round_.started) * 1e3,
            verify_back_ms=(round_.verify_back - round_.started) * 1e3,
            server_idle_ms=(round_.verify_start - loop.last_back) * 1e3,
            drafter_idle_ms=max(round_.drafter_idle_ms, 0.0),
            server_ms=max(r.server_ms for r in round_.results),
            server_prompt_tokens=sum(r.prompt_n for r in round_.results),
            round_ms=total_ms,
            catch_up=slots_lagged or round_.copied,
            refreshed=round_.refreshed and not slots_lagged,
            draft_probs=drafted.probs,
            fresh_tokens=drafted.fresh,
            fresh_ms=drafted.fresh_ms,
            resynced=drafted.resynced,
            runner_up_line=drafted.runner_up_line,
            drafted_ahead=round_.drafted_ahead,
            next_drafted=len(after.drafted.tokens) if after is not None else None,
            next_draft_ms=after.draft_ms if after is not None else 0.0,
            sent_ahead=round_.verify_task is not None,
            pad_tokens=round_.pad_result.prompt_n if round_.pad_result is not None else 0,
            padded=round_.pad_chosen,
        )
        loop.last_back = round_.verify_back
        copies = self.slots.take_copy_times()
        if round_log.isEnabledFor(logging.DEBUG):
            round_log.debug("round %s", _round_line(len(loop.rounds), round_, record, copies))
        if record.drafted_ahead is not None and after is None:
            loop.awaiting_overlap = record  # judged by the next round's draft
        self._close_round(loop, record)
        if after is not None:
            self.policies.observe_next_draft(record)
        if round_.plan.one_slot:
            loop.after_run = True

    def release_slots(self) -> asyncio.Task[list[int]] | None:
        """Once plain decoding is the gate's choice, empty the slots this generation
        filled, the one holding its context too (`SlotCopies.release`), in the
        background: the response does not wait for it."""
        if not self.policies.prefers_plain():
            return None
        return self.background.start(self.slots.release())

    def _close_round(self, loop: LoopState, record: RoundRecord) -> None:
        loop.rounds.append(record)
        self.policies.observe(record)
        if self.observer is not None:
            self.observer.observe_round(record)


def _round_line(index: int, round_: _Round, record: RoundRecord, copies: list[CopyTimes]) -> str:
    """One round as a JSON line (`--log-rounds`): what it drafted and accepted, its
    times, and per prompt the slot, the tokens it ingested and found cached and the
    server's time, where the round's cost comes from."""
    return json.dumps({
        "i": index, "k": round_.k, "n_drafted": record.n_drafted,
        "n_accepted": record.n_accepted, "n_context": len(round_.committed),
        "draft_ms": round(record.draft_ms, 2), "verify_ms": round(record.verify_ms, 2),
        "overhead_ms": round(record.overhead_ms, 2), "server_ms": round(record.server_ms, 2),
        "draft_ready_ms": round(record.draft_ready_ms, 2),
        "verify_sent_ms": round(record.verify_sent_ms, 2), "round_ms": round(record.round_ms, 2),
        "sent_ahead": record.sent_ahead, "catch_up": record.catch_up, "copied": round_.copied,
        "ahead": record.drafted_ahead, "reused": record.n_reused, "pad": record.pad_tokens,
        "padded": record.padded,
        # the slot copies it waited for: [save ms, restores ms, slots restored] each
        "copies": [times.as_list() for times in copies],
        "slots": [[r.id_slot, r.prompt_n, r.cached, round(r.server_ms, 2)] for r in round_.results],
    }, separators=(",", ":"))  # fmt: skip


def _run_line(
    index: int, n_context: int, run: PlainRun, record: RoundRecord, beside: str | None
) -> str:
    """One plain run as a JSON line (`--log-rounds`): its tokens, its wall time against
    the server's own, the proxy's work after it, how long the server sat idle before it,
    and what the drafter was asked for beside it: "timing" (the gate still waits for
    its speed: a timing draft started now, or one still running from an earlier run),
    "shadow" (a shadow check) or null; `drafter_busy` says whether it worked meanwhile."""
    return json.dumps({
        "i": index, "n_run_tokens": record.n_run_tokens, "n_context": n_context,
        "cached": run.cached,
        "run_ms": round(record.verify_ms, 2), "server_ms": round(run.server_ms, 2),
        "overhead_ms": round(record.overhead_ms, 2),
        "server_idle_ms": round(record.server_idle_ms, 2), "slot": run.id_slot,
        "beside": beside, "drafter_busy": record.drafter_busy,
    }, separators=(",", ":"))  # fmt: skip
