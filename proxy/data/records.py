"""What a generation reports: one frozen record per round, its frozen result, and the
metrics sink."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
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
    plain_run: bool = False  # the server decoded n_committed tokens alone (proxy.policies)
    # The round's timeline, ms since the round started (proxy.metrics sums the gaps):
    draft_ready_ms: float = 0.0  # the draft was ready
    verify_sent_ms: float = 0.0  # the verify (or plain-run) request went out
    verify_back_ms: float = 0.0  # its response was back
    # the server had no request of this generation: from the previous response (this
    # generation's start for the first round) until this request went out
    server_idle_ms: float = 0.0
    # the drafter had nothing to do while the server verified (not drafting ahead)
    drafter_idle_ms: float = 0.0
    # inside verify_ms: the server's own time for the batch (its slowest slot's prompt +
    # predicted ms; the rest is HTTP, JSON and task handling on both sides), and the
    # prompt tokens its slots ingested (the draft triangle plus what each slot lagged by)
    server_ms: float = 0.0
    server_prompt_tokens: int = 0
    # What the policies learn from (proxy.policies):
    round_ms: float = 0.0  # the whole round, wall time
    # the round's other slots caught up on plain-run tokens (or on the prompt, where the
    # first round prefilled one slot only), or slots were copied for it: its time says
    # little about speculation
    catch_up: bool = False
    # of those, a round whose only copy was a fresh one into a slot left behind
    # (`SlotCopies.refresh`): its verify time is a steady round's, its copy time is not
    refreshed: bool = False
    draft_probs: list[float] = field(default_factory=list)  # the draft's p per token
    # what the drafter itself spent on the tokens it drafted for this round (not taken
    # from drafting ahead), and whether the round started with a re-sync (no drafted
    # line held the committed sequence: a miss, or no drafting ahead)
    fresh_tokens: int = 0
    fresh_ms: float = 0.0
    resynced: bool = False
    # its draft came ready from a line drafted after the runner-up at the last round's
    # miss (proxy.engine.drafting.RunnerUpLines)
    runner_up_line: bool = False
    n_run_tokens: int = 0  # a plain run's tokens, also those past where the output stopped
    # a plain run during which the drafter worked in the background (a timing draft, its
    # prefill of the context): on a CPU drafter that slows the server's own host threads,
    # so its time is no measure of plain decoding (docs/BENCHMARKS.md, "Fourth run")
    drafter_busy: bool = False
    # whether the round drafted ahead during its verification, as the overlap policy
    # chose (None: no choice was made), and what the next round's draft then waited for
    drafted_ahead: bool | None = None
    next_drafted: int | None = None
    next_draft_ms: float = 0.0
    # its draft and verify request went out before the last round's tokens were
    # streamed and recorded (`--send-ahead`)
    sent_ahead: bool = False
    # tokens its pad prompt made the server ingest (`--pad-rounds`; 0: not padded)
    pad_tokens: int = 0
    # a round the engine could pad (`--pad-rounds`): whether it was; None: it could not
    padded: bool | None = None


@dataclass(frozen=True)
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


class RoundObserver(Protocol):
    """Metrics sink (proxy.metrics.ProxyMetrics implements it)."""

    def observe_round(self, record: RoundRecord) -> None: ...

    def observe_generation(self, n_tokens: int, seconds: float) -> None: ...

    def observe_drafter_failure(self) -> None: ...
