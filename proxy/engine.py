"""One generation's draft -> verify -> accept loop, greedy or sampling.

The engine knows nothing of HTTP routes. It takes prompt token ids and the few
request parameters it can honour losslessly (n_predict, stop strings, and in
sampling mode temperature/top_k/top_p/min_p/seed), and yields
one `TokenEvent` per generated token exactly as llama-server's `process_token`
would emit it, then a `GenerationResult`. The server's text bookkeeping (UTF-8
hold-back, stop strings, limits) is mirrored in `proxy.server_text`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from npu_draft.protocol import CancelToken, Draft, SamplingParams, SparseDist
from proxy.acceptance import (
    Acceptance,
    RngChooser,
    SampledAcceptance,
    Verdict,
    greedy_accept,
    normalized,
    speculative_sample,
)
from proxy.draft_length import DraftLengthPolicy, RoundCosts
from proxy.drafting import AsyncDrafter, AsyncSessionDrafter, GreedyDraft
from proxy.overlap_policy import OverlapPolicy
from proxy.plain_runs import PlainRunGate
from proxy.server_text import PieceCache, ServerTextState, TokenEvent, valid_utf8_prefix
from proxy.upstream import (
    SamplingSpec,
    UpstreamClient,
    UpstreamClientError,
    UpstreamError,
    VerifyResult,
)

log = logging.getLogger(__name__)

__all__ = ["AsyncDrafter", "AsyncSessionDrafter", "Generation", "GenerationParams"]


# -- the loop --------------------------------------------------------------------


@dataclass
class GenerationParams:
    n_predict: int = -1  # after merging the server's default; -1 means unlimited
    stop: list[str] = field(default_factory=list)
    k: int = 4  # the most drafts a round may verify
    sampling: SamplingSpec | None = None  # None: greedy
    adaptive: bool = True  # greedy: choose each round's length (proxy.draft_length)
    overlap: bool = True  # greedy: may draft while the server verifies (OverlapPolicy decides)
    # greedy: start the next round's draft as soon as the verify result is known, behind
    # the proxy's own work on the round (else when the next round starts)
    early_draft: bool = True


@dataclass
class RoundRecord:
    n_drafted: int
    n_accepted: int
    n_committed: int
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    decodes: int | None = None  # llamacpp:n_decode_total delta, when checked
    prompt_tokens: int | None = None  # llamacpp:prompt_tokens_total delta, when checked
    first: bool = False  # the round that also prefills the prompt into k+1 slots
    # sampling mode: drafts a match-only rule (draft == the server's own sampled token)
    # would have accepted in the same round; None in greedy mode
    n_matched: int | None = None
    n_reused: int = 0  # drafts that were ready from drafting ahead
    plain_run: bool = False  # the server decoded n_committed tokens alone (proxy.plain_runs)
    # The round's timeline, ms since the round started (proxy.metrics sums the gaps):
    draft_ready_ms: float = 0.0  # the draft was ready
    verify_sent_ms: float = 0.0  # the verify (or plain-run) request went out
    verify_back_ms: float = 0.0  # its response was back
    # the server had no request of this generation: from the previous response (this
    # generation's start for the first round) until this request went out
    server_idle_ms: float = 0.0
    # the drafter had nothing to do while the server verified (not drafting ahead)
    drafter_idle_ms: float = 0.0


@dataclass
class GenerationResult:
    tokens: list[int]
    content: bytes
    stop_type: str
    stopping_word: str
    truncated: bool
    has_new_line: bool
    n_prompt: int
    n_prompt_cached: int
    rounds: list[RoundRecord]
    prompt_ms: float
    predicted_ms: float
    drafter_failed: bool = False
    sampled: bool = False  # sampling mode (the Leviathan/Chen rule)

    @property
    def draft_n(self) -> int:
        return sum(r.n_drafted for r in self.rounds)

    @property
    def draft_n_accepted(self) -> int:
        return sum(r.n_accepted for r in self.rounds)

    @property
    def draft_n_matched(self) -> int:
        return sum(r.n_matched or 0 for r in self.rounds)

    @property
    def plain_run_n(self) -> int:
        """Tokens the server decoded alone (plain runs), not through verify rounds."""
        return sum(r.n_committed for r in self.rounds if r.plain_run)

    def timings(self) -> dict[str, float | int]:
        """llama-server's `timings` object (server-common.cpp server_slot_stats::to_json)."""
        n_gen = len(self.tokens)
        steps = max(n_gen - 1, 0)
        prompt_n = self.n_prompt - self.n_prompt_cached
        out: dict[str, float | int] = {
            "cache_n": self.n_prompt_cached,
            "prompt_n": prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / prompt_n if prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 / self.prompt_ms * prompt_n if self.prompt_ms > 0 else 0.0,
            "predicted_n": n_gen,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 / self.predicted_ms * steps
            if self.predicted_ms > 0
            else 0.0,
        }
        if self.draft_n > 0:
            out["draft_n"] = self.draft_n
            out["draft_n_accepted"] = self.draft_n_accepted
            if self.sampled:  # what greedy-match acceptance would have kept of the same drafts
                out["draft_n_accepted_greedy_match"] = self.draft_n_matched
        if self.plain_run_n > 0:  # of predicted_n, what plain runs wrote (not speculation)
            out["plain_run_n"] = self.plain_run_n
        return out


# a draft, its q in sampling mode, and the ms the round waited for it
DraftOutcome = tuple[GreedyDraft, list[SparseDist | None] | None, float]


class RoundObserver(Protocol):
    """Metrics sink (proxy.metrics.ProxyMetrics implements it)."""

    def observe_round(self, record: RoundRecord) -> None: ...

    def observe_generation(self, n_tokens: int, seconds: float) -> None: ...

    def observe_drafter_failure(self) -> None: ...


class DecodeCountError(AssertionError):
    """The server did more than one llama_decode for one verify round."""


class SlotReplicator:
    """Cold start without k+1 prefills: after a first plain round prefilled one slot,
    save that slot server-side and restore it into k idle slots (a save and a restore
    cost far less than a prefill; docs/BENCHMARKS.md, "Measurements behind design
    choices").

    Only speed depends on it: a failed or skipped copy means those slots prefill in
    the next verify batch, exactly as without replication.
    """

    def __init__(self, upstream: UpstreamClient, min_prompt: int = 64) -> None:
        self.upstream = upstream
        self.min_prompt = min_prompt  # shorter prompts prefill in the batch just as well
        self.available = True  # False once the server refused (no --slot-save-path)

    def worth_copying(self, n_fresh: int) -> bool:
        """Copy a slot only when its prefill would cost the others more than a copy."""
        return n_fresh >= self.min_prompt

    async def replicate(self, id_slot: int, copies: int, filename: str) -> int:
        """Copy slot `id_slot` into up to `copies` idle slots; returns how many."""
        if not self.available or copies <= 0 or id_slot < 0:
            return 0
        try:
            await self.upstream.slot_action(id_slot, "save", filename)
            slots = await self.upstream.slots()
            idle = [s["id"] for s in slots if not s.get("is_processing") and s["id"] != id_slot]
            for target in idle[:copies]:
                await self.upstream.slot_action(target, "restore", filename)
            return min(copies, len(idle))
        except (UpstreamClientError, UpstreamError) as exc:
            # 501 without --slot-save-path; whatever the cause, only speed is lost
            self.available = False
            log.warning("slot save/restore unavailable (%s); prefilling in the batch", exc)
            return 0


class Generation:
    """Iterate for TokenEvents; `result` is set when iteration ends."""

    def __init__(
        self,
        upstream: UpstreamClient,
        prompt: Sequence[int],
        params: GenerationParams,
        n_ctx: int,
        drafter: AsyncDrafter | None,
        pieces: PieceCache,
        observer: RoundObserver | None = None,
        check_decodes: bool = False,
        strict_decodes: bool = False,
        request_id: str = "-",
        replicator: SlotReplicator | None = None,
        slot_file: str = "npu-spec-prefill.bin",
        policy: DraftLengthPolicy | None = None,
        overlap_policy: OverlapPolicy | None = None,
        plain_runs: PlainRunGate | None = None,
    ) -> None:
        self.upstream = upstream
        self.prompt = list(prompt)
        self.params = params
        self.n_ctx = n_ctx
        self.drafter = drafter
        self.pieces = pieces
        self.observer = observer
        self.check_decodes = check_decodes or strict_decodes
        self.strict_decodes = strict_decodes
        self.request_id = request_id
        self.replicator = replicator
        self.slot_file = slot_file
        self.policy = policy or DraftLengthPolicy(params.k, params.adaptive)
        self.overlap_policy = overlap_policy or OverlapPolicy("auto" if params.overlap else "off")
        self.plain_runs = plain_runs  # None: always speculate
        self.result: GenerationResult | None = None
        self._ahead: asyncio.Task[None] | None = None
        self._ahead_cancel: CancelToken | None = None
        # when the current (or last) drafting ahead started and ended (perf_counter s)
        self._ahead_span: tuple[float, float | None] | None = None
        # the next round's draft, started when the verify result came back:
        # (the committed sequence it drafts after, its length, the drafting task)
        self._early: tuple[list[int], int, int, asyncio.Task[DraftOutcome]] | None = None

    async def _draft(
        self,
        committed: list[int],
        k: int,
        sampling: SamplingParams | None = None,
        rng: np.random.Generator | None = None,
        k_fresh: int | None = None,
    ) -> DraftOutcome:
        """(the draft, its q in sampling mode, ms the round waited for it). Greedy:
        at most `k_fresh` drafts where none was drafted ahead."""
        if k <= 0 or self.drafter is None:
            return GreedyDraft(), None, 0.0
        started = time.perf_counter()
        dists: list[SparseDist | None] | None = None
        await self._stop_ahead()
        try:
            if sampling is not None:
                assert rng is not None
                tokens, dists = await _propose_sampled(self.drafter, committed, k, sampling, rng)
                draft = GreedyDraft(tokens=tokens)
            elif k_fresh is not None and k_fresh < k:
                draft = await self.drafter.draft(committed, k, self.policy.worth, k_fresh)
            else:
                draft = await self.drafter.draft(committed, k, self.policy.worth)
        except asyncio.CancelledError:
            raise
        except Exception:
            await _close_quietly(self._drop_drafter())
            return GreedyDraft(), None, (time.perf_counter() - started) * 1e3
        draft.tokens, draft.probs = draft.tokens[:k], draft.probs[:k]
        return draft, dists, (time.perf_counter() - started) * 1e3

    def _start_early_draft(self, committed: list[int], k: int, k_fresh: int) -> None:
        """Draft the next round now (after `committed`, up to k), while the proxy
        commits this round's tokens; `_take_draft` picks it up."""
        if k <= 0 or self.drafter is None or not self.drafter.early_draft:
            return
        task = asyncio.create_task(self._draft(committed, k, k_fresh=k_fresh))
        self._early = (committed, k, k_fresh, task)

    async def _drop_early_draft(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early[3].cancel()
            await asyncio.gather(early[3], return_exceptions=True)

    async def _take_draft(self, committed: list[int], k: int, k_fresh: int) -> DraftOutcome:
        """The greedy draft of up to k tokens (k_fresh where none was drafted ahead)
        after `committed`: the early draft where it drafted after the same sequence
        (extended where it is shorter), else now. The time returned is what this call
        waited."""
        early, self._early = self._early, None
        if early is None:
            return await self._draft(committed, k, k_fresh=k_fresh)
        early_committed, early_k, early_fresh, task = early
        started = time.perf_counter()
        drafted, dists, _ = await task
        if early_committed != committed or early_k < k or early_fresh < min(k_fresh, k):
            # another sequence (a plain run came between), or a longer draft wanted now:
            # the line keeps what was drafted, so drafting again reuses it
            return await self._draft(committed, k, k_fresh=k_fresh)
        drafted.tokens, drafted.probs = drafted.tokens[:k], drafted.probs[:k]
        return drafted, dists, (time.perf_counter() - started) * 1e3

    def _drop_drafter(self) -> AsyncDrafter | None:
        """Lossless either way: without a draft every round is plain decoding."""
        log.exception("[%s] drafter failed; plain decoding for this request", self.request_id)
        if self.observer is not None:
            self.observer.observe_drafter_failure()
        self._drafter_failed = True
        drafter, self.drafter = self.drafter, None
        return drafter

    def _ahead_expected(self) -> bool:
        """Whether rounds draft ahead as things stand (what the draft length assumes)."""
        if not self.params.overlap or self.drafter is None or not self.drafter.draft_ahead:
            return False
        policy = self.overlap_policy
        return policy.mode == "on" or (policy.mode == "auto" and policy.best())

    def _start_ahead(self) -> bool:
        """While the server verifies, keep drafting the line as if all is accepted.
        Whether to is the overlap policy's measured choice; returns that choice, or
        False where drafting ahead is off or the drafter cannot."""
        drafter = self.drafter
        if not self.params.overlap or drafter is None or not drafter.draft_ahead:
            return False
        if not self.overlap_policy.choose():
            return False
        self._ahead_cancel = cancel = CancelToken()
        started = time.perf_counter()
        self._ahead_span = (started, None)

        async def run() -> None:
            try:
                # the bonus guess and the next round's drafts
                await drafter.extend(self.policy.length(True) + 1, cancel)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("[%s] drafting ahead failed", self.request_id, exc_info=True)
            finally:
                self._ahead_span = (started, time.perf_counter())

        self._ahead = asyncio.create_task(run())
        return True

    async def _stop_ahead(self) -> None:
        """Stop drafting ahead (it ends after the token in progress) and wait for it."""
        if self._ahead is None:
            return
        assert self._ahead_cancel is not None
        self._ahead_cancel.cancel()
        ahead, self._ahead = self._ahead, None
        await asyncio.gather(ahead, return_exceptions=True)

    def _drafter_busy_ms(self, start: float, end: float) -> float:
        """How long drafting ahead ran within [start, end] (perf_counter seconds)."""
        if self._ahead_span is None:
            return 0.0
        ahead_start, ahead_end = self._ahead_span
        busy = min(end if ahead_end is None else ahead_end, end) - max(ahead_start, start)
        return max(busy, 0.0) * 1e3

    def _plain_run_length(self, rounds: list[RoundRecord], room: int) -> int:
        """Tokens the server should decode alone next (0: a speculative round); never
        in the first round, which prefills the slots."""
        if self.plain_runs is None or not rounds or self.drafter is None:
            return 0
        return max(0, min(self.plain_runs.choose(), room))

    async def _plain_run(
        self, state: ServerTextState, committed: list[int], n: int, seed: int, round_start: float
    ) -> tuple[list[TokenEvent], RoundRecord, int, int]:
        """(events, record, tokens the server decoded, the slot holding them) of one
        plain run."""
        await self._stop_ahead()  # its line would be stale after the run
        started = time.perf_counter()
        run = await self.upstream.plain_run(committed, n, self.params.sampling, seed)
        back = time.perf_counter()
        run_ms = (back - started) * 1e3
        pieces = await self.pieces.run_pieces(run.tokens, run.content)
        last = len(run.tokens) - 1
        if run.stop_type == "eos":
            pieces[last] = b""  # the server writes no text for the EOG token
        events: list[TokenEvent] = []
        for i, (token, piece) in enumerate(zip(run.tokens, pieces, strict=True)):
            events.append(state.push(token, piece, i == last and run.stop_type == "eos"))
            if state.finished:
                break
        record = RoundRecord(
            n_drafted=0,
            n_accepted=0,
            n_committed=len(events),
            draft_ms=0.0,
            verify_ms=run_ms,
            overhead_ms=(time.perf_counter() - started) * 1e3 - run_ms,
            plain_run=True,
            draft_ready_ms=(started - round_start) * 1e3,
            verify_sent_ms=(started - round_start) * 1e3,
            verify_back_ms=(back - round_start) * 1e3,
            drafter_idle_ms=run_ms,
        )
        return events, record, len(run.tokens), run.id_slot

    async def _copy_context_slot(self, id_slot: int, lag: int) -> None:
        """Before speculating after plain runs (or after a first round that prefilled
        one slot): copies of that slot, where copying is on and the others lag by
        enough tokens to be worth it."""
        replicator = self.replicator
        if replicator is None or not replicator.available or not replicator.worth_copying(lag):
            return
        await replicator.replicate(id_slot, self.policy.slots_to_copy(), self.slot_file)

    async def _counters(self) -> tuple[int, int]:
        """(llamacpp:n_decode_total, llamacpp:prompt_tokens_total) right now."""
        values = await self.upstream.metrics()
        return int(values["llamacpp:n_decode_total"]), int(values["llamacpp:prompt_tokens_total"])

    async def run(self) -> AsyncIterator[TokenEvent]:
        state = ServerTextState(
            self.params.stop, len(self.prompt), self.n_ctx, self.params.n_predict
        )
        self._drafter_failed = False
        rounds: list[RoundRecord] = []
        started = time.perf_counter()
        first_round_end: float | None = None
        n_cached = 0
        counters_before = await self._counters() if self.check_decodes else None
        sampling = self.params.sampling
        if sampling is not None:
            # Independent streams for the draft's draws, the rule's and the server's
            # seeds: a request seed replays all three, so the output reproduces.
            streams = np.random.SeedSequence(sampling.seed).spawn(3)
            draft_rng, rule_rng, seed_rng = (np.random.default_rng(s) for s in streams)
            chooser = RngChooser(rule_rng)
            eog = await self.pieces.eog_tokens()
        # the last round's (drafted ahead?, drafts, verify ms), judged after the next draft
        pending_overlap: tuple[bool, int, float] | None = None
        chose_ahead: bool | None = None
        # the next round's other slots catch up: on a plain run's tokens, or on the whole
        # prompt where the first round prefilled one slot only and copied none
        after_run = False
        # while the other slots lag: the one that holds the whole context, and by how
        # many tokens the others lag at least (fresh prompt tokens, plain-run tokens)
        context_slot, lag = -1, 0
        last_back = started  # when the server last answered this generation
        try:
            while not state.finished:
                round_start = time.perf_counter()
                committed = self.prompt + state.tokens
                # Never draft past what the server may still produce: the last prompt
                # of the batch must stay below the slot's context, and the round
                # commits at most k+1 tokens.
                room = state.remaining()
                run_n = self._plain_run_length(rounds, room)
                if run_n:
                    assert self.plain_runs is not None
                    pending_overlap = None
                    seed = 0 if sampling is None else int(seed_rng.integers(0, 0xFFFFFFFF))
                    events, record, n_decoded, context_slot = await self._plain_run(
                        state, committed, run_n, seed, round_start
                    )
                    record.server_idle_ms = (
                        round_start + record.verify_sent_ms / 1e3 - last_back
                    ) * 1e3
                    last_back = round_start + record.verify_back_ms / 1e3
                    lag += n_decoded
                    for event in events:
                        yield event
                    if counters_before is not None:
                        counters_after = await self._counters()
                        record.decodes = counters_after[0] - counters_before[0]
                        record.prompt_tokens = counters_after[1] - counters_before[1]
                        counters_before = counters_after
                    rounds.append(record)
                    self.plain_runs.observe_run(record.verify_ms, n_decoded)
                    if self.observer is not None:
                        self.observer.observe_round(record)
                    after_run = True
                    continue
                if after_run and context_slot >= 0:
                    # Speculation again after plain runs: copy the slot that holds the
                    # context into the slots the rounds use, instead of letting each of
                    # them prefill what it lags by inside the next verify batch.
                    await self._copy_context_slot(context_slot, lag)
                context_slot, lag = -1, 0
                k = max(0, min(self.params.k, room - 1))
                # While plain runs are the cheaper side, a new request starts with one
                # slot and no copies: copying a long context costs more (a slot holds the
                # whole context's KV; docs/BENCHMARKS.md, "Measurements behind design
                # choices") than a later probe of speculation pays to catch up the few
                # slots it uses.
                first_draft = not rounds and self.drafter is not None
                plain_first = (
                    first_draft and self.plain_runs is not None and self.plain_runs.prefers_plain()
                )
                replicate = (
                    first_draft
                    and not plain_first
                    and self.replicator is not None
                    and self.replicator.available
                    and len(self.prompt) >= self.replicator.min_prompt
                )
                if replicate or plain_first:
                    k = 0  # prefill one slot only (copies of it follow where replicating)
                if sampling is None:
                    ahead = self._ahead_expected()
                    k = min(k, self.policy.length(ahead))
                    k_fresh = min(k, self.policy.fresh_length(ahead))
                    drafted, dists, draft_ms = await self._take_draft(committed, k, k_fresh)
                    draft = drafted.tokens
                    draft_ready = verify_start = time.perf_counter()
                    if pending_overlap is not None:  # the last round's choice, judged
                        self.overlap_policy.observe(
                            *pending_overlap, next_drafted=len(draft), next_draft_ms=draft_ms
                        )
                        pending_overlap = None
                    chose_ahead = self._start_ahead() if draft else None
                    results = await self.upstream.verify(committed, draft)
                else:
                    drafted, dists, draft_ms = await self._draft(
                        committed, k, sampling.chain, draft_rng
                    )
                    draft = drafted.tokens
                    draft_ready = verify_start = time.perf_counter()
                    server_seed = int(seed_rng.integers(0, 0xFFFFFFFF))  # 0xFFFFFFFF: random
                    results = await self.upstream.verify(committed, draft, sampling, server_seed)
                verify_back = time.perf_counter()
                verify_ms = (verify_back - verify_start) * 1e3
                drafter_idle_ms = verify_ms
                if chose_ahead:
                    drafter_idle_ms -= self._drafter_busy_ms(verify_start, verify_back)
                if sampling is None and chose_ahead is not None and self.params.overlap:
                    pending_overlap = (chose_ahead, len(draft), verify_ms)
                if first_round_end is None:
                    n_cached = results[0].cached
                acceptance: Acceptance
                if sampling is None:
                    acceptance = greedy_accept(draft, [r.token for r in results])
                else:
                    verdicts = [verdict_of(r) for r in results]
                    acceptance = speculative_sample(draft, dists, verdicts, chooser)
                if sampling is None and self.params.early_draft:
                    # the next round's committed sequence is known: draft it while this
                    # round's tokens are committed (wasted only where the generation stops)
                    room_next = room - len(acceptance.tokens)
                    k_next = min(self.params.k, room_next - 1)
                    ahead = self._ahead_expected()
                    k_next = min(k_next, self.policy.length(ahead))
                    k_fresh = min(k_next, self.policy.fresh_length(ahead))
                    self._start_early_draft(committed + acceptance.tokens, k_next, k_fresh)
                n_committed = 0
                for position, token in enumerate(acceptance.tokens):
                    result = results[position]
                    if sampling is None or token == result.token:
                        piece, is_eog = await self.pieces.piece(result), result.is_eog
                    else:  # our own draw: its bytes come with the server's candidates
                        piece = _candidate_piece(result, token)
                        if piece is None:
                            piece = await self.pieces.token_piece(token)
                        is_eog = token in eog
                    event = state.push(token, piece, is_eog)
                    n_committed += 1
                    yield event
                    if state.finished:
                        break
                # A new turn of a conversation whose slots already hold its history
                # has little to copy: the other slots catch up in the next batch.
                fresh = len(self.prompt) - results[0].cached
                if replicate and not state.finished and self.replicator.worth_copying(fresh):
                    assert self.replicator is not None
                    await self.replicator.replicate(
                        results[0].id_slot, self.policy.slots_to_copy(), self.slot_file
                    )
                if first_round_end is None:
                    first_round_end = time.perf_counter()
                if plain_first:
                    context_slot, lag = results[0].id_slot, len(self.prompt) - results[0].cached
                decodes = prompt_tokens = None
                if counters_before is not None:
                    counters_after = await self._counters()
                    decodes = counters_after[0] - counters_before[0]
                    prompt_tokens = counters_after[1] - counters_before[1]
                    counters_before = counters_after
                    if decodes != 1 and rounds:  # a first round may prefill in batches
                        message = (
                            f"[{self.request_id}] round {len(rounds)} took {decodes} server "
                            "decodes instead of 1 (check -kvu, --no-cache-idle-slots, -cram 0, -c)"
                        )
                        if self.strict_decodes:
                            raise DecodeCountError(message)
                        log.warning(message)
                total_ms = (time.perf_counter() - round_start) * 1e3
                record = RoundRecord(
                    n_drafted=len(draft),
                    n_accepted=acceptance.n_accepted,
                    n_committed=n_committed,
                    draft_ms=draft_ms,
                    verify_ms=verify_ms,
                    overhead_ms=max(total_ms - draft_ms - verify_ms, 0.0),
                    decodes=decodes,
                    prompt_tokens=prompt_tokens,
                    first=not rounds,
                    n_matched=acceptance.n_matched
                    if isinstance(acceptance, SampledAcceptance)
                    else None,
                    n_reused=drafted.reused,
                    draft_ready_ms=(draft_ready - round_start) * 1e3,
                    verify_sent_ms=(verify_start - round_start) * 1e3,
                    verify_back_ms=(verify_back - round_start) * 1e3,
                    server_idle_ms=(verify_start - last_back) * 1e3,
                    drafter_idle_ms=max(drafter_idle_ms, 0.0),
                )
                last_back = verify_back
                rounds.append(record)
                steady = not record.first and not after_run
                if self.plain_runs is not None and steady:
                    self.plain_runs.observe_round(total_ms, n_committed)
                elif self.plain_runs is not None and after_run:
                    self.plain_runs.observe_catch_up(total_ms, n_committed)
                after_run = plain_first
                # a catch-up round's verify time says nothing about the draft length
                if steady and drafted.probs:
                    self.policy.observe(
                        RoundCosts(
                            probs=drafted.probs,
                            n_accepted=record.n_accepted,
                            n_committed=record.n_committed,
                            draft_ms=draft_ms,
                            verify_ms=verify_ms,
                            round_ms=total_ms,
                            fresh_tokens=drafted.fresh,
                            fresh_ms=drafted.fresh_ms,
                            resynced=drafted.resynced,
                            overhead_ms=record.overhead_ms,
                        )
                    )
                if self.plain_runs is not None and drafted.fresh > 0:
                    # the drafter's own speed: a drafter too slow to win is told apart
                    self.plain_runs.observe_drafter(drafted.fresh_ms / drafted.fresh)
                if self.observer is not None:
                    self.observer.observe_round(record)
        finally:
            await self._drop_early_draft()
            await self._stop_ahead()
            if self.drafter is not None:
                await _close_quietly(self.drafter)
        end = time.perf_counter()
        first_round_end = first_round_end or end
        self.result = GenerationResult(
            tokens=list(state.tokens),
            content=bytes(state.generated),
            stop_type=state.stop_type,
            stopping_word=state.stopping_word,
            truncated=state.truncated,
            has_new_line=state.has_new_line,
            n_prompt=len(self.prompt),
            n_prompt_cached=n_cached,
            rounds=rounds,
            prompt_ms=(first_round_end - started) * 1e3,
            predicted_ms=(end - first_round_end) * 1e3,
            drafter_failed=self._drafter_failed,
            sampled=sampling is not None,
        )
        if self.observer is not None:
            self.observer.observe_generation(len(state.tokens), end - started)


async def _propose_sampled(
    drafter: AsyncDrafter,
    committed: list[int],
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


def verdict_of(result: VerifyResult) -> Verdict:
    """The rule's view of one sampling verify result."""
    if not result.candidates:
        return Verdict(result.token, None)
    ids = np.array([c[0] for c in result.candidates], dtype=np.int64)
    probs = np.array([c[2] for c in result.candidates], dtype=np.float64)
    dist = normalized(ids, probs)  # float32 values in the JSON: renormalise
    # the candidates whose piece alone ends inside a UTF-8 character: had the server
    # drawn one of them it would have sent no probabilities (see speculative_sample)
    partial = frozenset(c[0] for c in result.candidates if valid_utf8_prefix(c[1]) < len(c[1]))
    return Verdict(result.token, dist, partial)


def _candidate_piece(result: VerifyResult, token: int) -> bytes | None:
    for candidate, piece, _prob in result.candidates or ():
        if candidate == token:
            return piece
    return None


async def _close_quietly(drafter: AsyncDrafter | None) -> None:
    if drafter is None:
        return
    try:
        await drafter.close()
    except Exception:  # closing must never mask the request's own outcome
        log.exception("closing the draft session failed")
