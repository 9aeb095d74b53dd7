"""One generation: rounds until the server's text is finished, greedy or sampling.

The engine knows nothing of HTTP routes. It takes prompt token ids and the few
request parameters it can honour losslessly (n_predict, stop strings, and in
sampling mode temperature/top_k/top_p/min_p/seed), and yields one `TokenEvent` per
generated token exactly as llama-server's `process_token` would emit it, then a
`GenerationResult`. The server's text bookkeeping (UTF-8 hold-back, stop strings,
limits) is mirrored in `proxy.engine.server_text`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from proxy.data.records import GenerationResult, RoundObserver
from proxy.engine.background import BackgroundTasks
from proxy.engine.decode_check import DecodeCounter
from proxy.engine.drafting import AsyncDrafter
from proxy.engine.loop_state import LoopState
from proxy.engine.proposer import DraftGuard, Proposer, SampledDrafts
from proxy.engine.rounds import Rounds
from proxy.engine.rules import SamplingRule, rule_for
from proxy.engine.server_text import PieceCache, ServerTextState, TokenEvent
from proxy.engine.settings import EngineSettings, GenerationParams
from proxy.engine.slot_copies import SlotCopies, SlotReplicator
from proxy.policies import Policies
from proxy.server.upstream import UpstreamClient

log = logging.getLogger(__name__)


class Generation:
    """Iterate `run()` for TokenEvents; `result` is set when iteration ends.

    `policies` default to fresh ones from `settings` (`EngineSettings.policies`): a
    proxy passes the ones its requests share, the guard its drafter sessions answer to
    (`proxy.drafter_guard.DrafterSupervisor`) and the owner of the work generations
    leave running (`BackgroundTasks`; by default the generation's own)."""

    def __init__(
        self,
        upstream: UpstreamClient,
        prompt: Sequence[int],
        params: GenerationParams,
        n_ctx: int,
        drafter: AsyncDrafter | None,
        pieces: PieceCache,
        observer: RoundObserver | None = None,
        settings: EngineSettings | None = None,
        request_id: str = "-",
        replicator: SlotReplicator | None = None,
        slot_file: str = "npu-spec-prefill.bin",
        policies: Policies | None = None,
        guard: DraftGuard | None = None,
        background: BackgroundTasks | None = None,
    ) -> None:
        self.upstream = upstream
        self.prompt = list(prompt)
        self.params = params
        self.n_ctx = n_ctx
        self.drafter = drafter
        self.pieces = pieces
        self.observer = observer
        self.settings = settings = settings or EngineSettings()
        self.request_id = request_id
        self.replicator = replicator
        self.slot_file = slot_file
        self.policies = policies or settings.policies().for_request(params.sampling)
        self.guard = guard
        self.background = background if background is not None else BackgroundTasks()
        self.result: GenerationResult | None = None
        # emptying the slots of a generation that ended with plain decoding chosen
        self.releasing: asyncio.Task[list[int]] | None = None

    async def run(self) -> AsyncIterator[TokenEvent]:
        loop = LoopState(
            ServerTextState(self.params.stop, len(self.prompt), self.n_ctx, self.params.n_predict),
            started=(started := time.perf_counter()),
            last_back=started,
        )
        try:
            rounds = await self._rounds()
            if self.replicator is not None:
                await self.replicator.clear_stale(self.prompt)
        except BaseException:  # the drafter session ends with the request (its KV slot)
            if self.drafter is not None:
                with contextlib.suppress(Exception):  # never masks the request's own error
                    await self.drafter.close()
            raise
        try:
            while not loop.text.finished:
                round_start = time.perf_counter()
                run_n = rounds.plain_run_length(loop)
                steps = (
                    rounds.plain_run(loop, run_n, round_start)
                    if run_n
                    else rounds.speculative_round(loop, round_start)
                )
                async for event in steps:
                    yield event
        finally:
            try:
                await rounds.abandon()
                rounds.slots.leave(self.prompt + loop.text.tokens)
            finally:
                await rounds.proposer.close()
        self._finish(loop, rounds)
        self.releasing = rounds.release_slots()

    async def _rounds(self) -> Rounds:
        """This generation's round machinery: decode counting (read once now), the
        greedy or sampling rule, the proposer, slot copies."""
        settings, policies = self.settings, self.policies
        decodes = DecodeCounter(
            self.upstream, settings.check_decodes, settings.strict_decodes, self.request_id
        )
        await decodes.start()
        rule = await rule_for(self.params.sampling, self.pieces)
        sampled = (
            SampledDrafts(rule.spec.chain, rule.draft_rng)
            if isinstance(rule, SamplingRule)
            else None
        )
        proposer = Proposer(
            self.drafter,
            policies,
            settings.early_draft,
            sampled,
            self.guard,
            self.background,
            self.request_id,
            self.observer,
            settings.runner_up_lines,
        )
        slots = SlotCopies(
            self.replicator,
            self.slot_file,
            len(self.prompt),
            policies.draft_length.slots_to_copy,
            self.prompt,
        )
        return Rounds(
            self.upstream, self.prompt, self.pieces, settings.k, rule, proposer, policies, slots,
            decodes, self.observer, self.background, settings.send_ahead,
            policies.padding.enabled() and not sampled,
        )  # fmt: skip

    def _finish(self, loop: LoopState, rounds: Rounds) -> None:
        end = time.perf_counter()
        first_round_end = loop.first_round_end or end
        text = loop.text
        self.result = GenerationResult(
            tokens=list(text.tokens),
            content=bytes(text.generated),
            stop_type=text.stop_type,
            stopping_word=text.stopping_word,
            truncated=text.truncated,
            has_new_line=text.has_new_line,
            n_prompt=len(self.prompt),
            n_prompt_cached=loop.n_cached,
            rounds=loop.rounds,
            prompt_ms=(first_round_end - loop.started) * 1e3,
            predicted_ms=(end - first_round_end) * 1e3,
            drafter_failed=rounds.proposer.failed,
            sampled=rounds.rule.sampled,
        )
        if self.observer is not None:
            self.observer.observe_generation(len(text.tokens), end - loop.started)
        self.policies.observe_generation(len(text.tokens))
        verify = [r for r in loop.rounds if not r.plain_run]
        log.info(
            "[%s] done: %d tokens in %.2f s (first %.0f ms); %d verify rounds (%d drafted, "
            "%d accepted), %d tokens by plain runs",
            self.request_id, len(text.tokens), end - loop.started, self.result.prompt_ms,
            len(verify), sum(r.n_drafted for r in verify), sum(r.n_accepted for r in verify),
            sum(r.n_committed for r in loop.rounds if r.plain_run),
        )  # fmt: skip
