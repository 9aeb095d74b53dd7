"""Drafting ahead and the draft-length policy, with a deterministic fake drafter."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Sequence

import numpy as np
import pytest

from npu_draft.protocol import GREEDY, CancelToken, Draft, SamplingParams, SyncStats
from proxy.engine import EngineSettings, RoundRecord
from proxy.engine.background import BackgroundTasks
from proxy.engine.drafting import AsyncSessionDrafter, GreedyDraft, always
from proxy.engine.proposer import Proposer, SampledDrafts
from proxy.policies import DraftLengthPolicy, OverlapPolicy


def next_token(tokens: Sequence[int]) -> int:
    return (tokens[-1] * 7 + len(tokens)) % 97


class CountingSession:
    """Greedy draft = a fixed function of the sequence; counts the tokens it computes."""

    def __init__(self, prob: float = 0.9) -> None:
        self._tokens: list[int] = []
        self.prob = prob
        self.computed = 0
        self.syncs = 0

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        self.syncs += 1
        self._tokens = list(tokens)
        return SyncStats(reused=0, appended=len(tokens))

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        draft = Draft()
        for _ in range(k):
            if cancel is not None and cancel.cancelled:
                break
            self.draft_one(draft)
            self._tokens.append(draft.tokens[-1])
            self.computed += 1
        return draft

    def draft_one(self, draft: Draft) -> None:
        """Append the next token after the sequence (and its p) to `draft`."""
        draft.tokens.append(next_token(self._tokens))
        draft.probs.append(self.prob)

    def next_logits(self) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


def expected_draft(committed: Sequence[int], k: int) -> list[int]:
    line = list(committed)
    for _ in range(k):
        line.append(next_token(line))
    return line[len(committed) :]


async def test_drafted_ahead_tokens_are_reused_when_the_block_and_bonus_hit():
    session = CountingSession()
    drafter = AsyncSessionDrafter(session)
    committed = [1, 2, 3]
    try:
        first = await drafter.draft(committed, 4, always)
        assert first.tokens == expected_draft(committed, 4) and first.reused == 0
        assert await drafter.extend(5, CancelToken()) == 5
        # the server accepted all 4 and its bonus equals the drafter's next token
        line = committed + first.tokens
        line.append(next_token(line))
        computed = session.computed
        second = await drafter.draft(line, 4, always)
        assert second.tokens == expected_draft(line, 4)
        assert second.reused == 4 and session.computed == computed  # nothing recomputed
        assert second.probs == [session.prob] * 4
    finally:
        await drafter.close()


async def test_a_miss_resyncs_and_drafts_fresh():
    session = CountingSession()
    drafter = AsyncSessionDrafter(session)
    committed = [5, 6]
    try:
        first = await drafter.draft(committed, 3, always)
        await drafter.extend(4, CancelToken())
        correction = (first.tokens[1] + 1) % 97  # the server disagreed at position 2
        line = committed + first.tokens[:1] + [correction]
        syncs = session.syncs
        second = await drafter.draft(line, 3, always)
        assert second.tokens == expected_draft(line, 3) and second.reused == 0
        assert session.syncs == syncs + 1
    finally:
        await drafter.close()


async def test_extend_stops_when_cancelled():
    drafter = AsyncSessionDrafter(CountingSession())
    try:
        await drafter.draft([1], 2, always)
        cancel = CancelToken()
        cancel.cancel()
        assert await drafter.extend(10, cancel) == 0
    finally:
        await drafter.close()


async def test_stop_rule_cuts_the_draft_and_keeps_the_cut_token_on_the_line():
    session = CountingSession(prob=0.5)
    drafter = AsyncSessionDrafter(session)
    try:
        draft = await drafter.draft([9], 8, lambda position, p: p >= 0.2)
        # 0.5, 0.25 pass; 0.125 fails at position 3
        assert draft.tokens == expected_draft([9], 2)
        assert list(session.tokens) == [9, *expected_draft([9], 3)]
    finally:
        await drafter.close()


def steady_round(
    probs: Sequence[float],
    n_accepted: int,
    n_committed: int,
    draft_ms: float,
    verify_ms: float,
    round_ms: float,
    overhead_ms: float = 0.0,
    **more,
) -> RoundRecord:
    """A steady verify round, as the draft-length policy sees it."""
    return RoundRecord(
        len(probs), n_accepted, n_committed, draft_ms, verify_ms, overhead_ms,
        round_ms=round_ms, draft_probs=list(probs), **more,
    )  # fmt: skip


def feed(policy: DraftLengthPolicy, rounds: int, prob: float, accepted: int, **costs) -> None:
    k = policy.k_max
    for _ in range(rounds):
        policy.observe(
            steady_round(
                probs=[prob] * k,
                n_accepted=accepted,
                n_committed=accepted + 1,
                draft_ms=costs.get("draft_ms", 4.0) * k,
                verify_ms=costs.get("verify_ms", 20.0),
                round_ms=costs.get("round_ms", 40.0),
            )
        )


def drafted_length(policy: DraftLengthPolicy, prob: float) -> int:
    n, cumulative = 0, 1.0
    for position in range(1, 20):
        cumulative *= prob
        if not policy.worth(position, cumulative):
            break
        n = position
    return n


def test_policy_drafts_everything_until_it_has_measurements():
    policy = DraftLengthPolicy(6, rule="marginal")
    assert drafted_length(policy, 0.01) == 6
    fixed = DraftLengthPolicy(6, adaptive=False, rule="marginal")
    feed(fixed, 10, 0.5, 0)
    assert drafted_length(fixed, 0.01) == 6


def test_policy_drafts_less_when_drafts_are_rejected_and_more_when_accepted():
    poor = DraftLengthPolicy(8, rule="marginal")
    feed(poor, 10, 0.9, 0, draft_ms=4.0)  # confident drafts, none accepted
    good = DraftLengthPolicy(8, rule="marginal")
    feed(good, 10, 0.9, 6, draft_ms=1.0)
    assert drafted_length(poor, 0.9) == 1  # position 1 is always drafted
    assert drafted_length(good, 0.9) > 4


@pytest.mark.parametrize("draft_ms", [0.5, 8.0])
def test_policy_weighs_draft_cost(draft_ms):
    policy = DraftLengthPolicy(8, rule="marginal")
    feed(policy, 10, 0.8, 3, draft_ms=draft_ms)
    cheap = draft_ms < 1
    assert (drafted_length(policy, 0.8) >= 5) == cheap


def test_policy_fits_the_verify_slope():
    policy = DraftLengthPolicy(8, rule="marginal")
    for k in (2, 4, 6, 8) * 4:
        policy.observe(steady_round([0.9] * k, 1, 2, 4.0, 10.0 + 2.5 * k, 40.0))
    assert policy.verify_slope_ms() == pytest.approx(2.5)


def test_a_round_made_current_by_a_fresh_copy_counts_its_verify_time_not_its_copy():
    """A catch-up round says nothing about its draft length, unless its only copy was a
    fresh one into a slot left behind: then its verify time is a steady round's (a
    2-draft round on the Strix Halo 14B, explored among 1-draft ones), and the copy's
    time, in its round and overhead, is left out."""
    policy = DraftLengthPolicy(2)
    for _ in range(4):
        policy.observe(steady_round([0.9], 1, 2, 2.0, 50.0, 55.0, overhead_ms=1.0))
    rounds, proxy_ms = policy.rounds, policy.proxy_ms
    policy.observe(steady_round([0.9, 0.9], 2, 3, 4.0, 140.0, 900.0, 700.0, catch_up=True))
    assert policy.rounds == rounds and 2 not in policy._by_length  # a stale slot caught up
    refreshed = steady_round(
        [0.9, 0.9], 2, 3, 4.0, 60.0, 160.0, 95.0, catch_up=True, refreshed=True
    )
    policy.observe(refreshed)
    assert policy.rounds == rounds + 1
    assert policy._by_length[2] == (60.0, 1)
    assert policy.proxy_ms == proxy_ms and policy.round_ms == pytest.approx(55.0)


def test_slots_to_copy_follow_the_rounds():
    policy = DraftLengthPolicy(6)
    assert policy.slots_to_copy() == 6  # nothing measured: every slot a round may use
    for _ in range(8):
        policy.observe(steady_round([0.9], 1, 2, 2.0, 20.0, 30.0))
    assert policy.slots_to_copy() == 1  # rounds of 2 prompts: the prefilled slot and one
    assert DraftLengthPolicy(6, adaptive=False).slots_to_copy() == 6


def run_rounds(policy, rounds: int, penalty_ms: float, draft_ms_per_token: float, hit: float):
    """Rounds of 2 drafts; drafting ahead slows verification by `penalty_ms` and leaves
    the next draft ready with probability `hit` (else it waits for half a token more)."""
    rng = np.random.default_rng(0)
    choices = []
    for _ in range(rounds):
        ahead = policy.decide(True)
        choices.append(ahead)
        verify = 40.0 + (penalty_ms if ahead else 0.0) + rng.normal(0, 1)
        if ahead and rng.random() < hit:
            next_draft = 0.2
        else:
            next_draft = 2 * draft_ms_per_token + (0.5 * draft_ms_per_token if ahead else 0)
        policy.observe(
            RoundRecord(2, 0, 1, 0.0, verify, 0.0, drafted_ahead=ahead, next_drafted=2,
                        next_draft_ms=next_draft)
        )  # fmt: skip
    return choices


def test_overlap_policy_keeps_drafting_ahead_where_it_costs_verification_nothing():
    policy = OverlapPolicy("auto")
    choices = run_rounds(policy, 200, penalty_ms=0.0, draft_ms_per_token=5.0, hit=0.5)
    assert choices[:24].count(True) == choices[:24].count(False) == 12  # both tried first
    assert policy.best() is True
    later = choices[40:]
    assert later.count(False) <= len(later) / 8 + 1  # only the periodic re-tries


def test_overlap_policy_tries_the_losing_choice_less_and_less_often():
    """Drafting ahead on a processor of its own never slows verification: each try of
    "off" only loses a round's drafting, so the tries thin out to one in 64 rounds."""
    policy = OverlapPolicy("auto")
    choices = run_rounds(policy, 1200, penalty_ms=0.0, draft_ms_per_token=5.0, hit=0.5)
    assert policy.best() is True
    late = choices[400:]
    assert late.count(False) <= len(late) / 64 + 1


def test_overlap_policy_drops_drafting_ahead_when_it_slows_verification_more_than_it_saves():
    policy = OverlapPolicy("auto")
    choices = run_rounds(policy, 200, penalty_ms=14.0, draft_ms_per_token=9.0, hit=0.5)
    assert policy.best() is False
    later = choices[40:]
    assert later.count(True) <= len(later) / 8 + 1
    # the load changes: drafting ahead stops slowing verification; the re-tries see it
    run_rounds(policy, 800, penalty_ms=0.0, draft_ms_per_token=9.0, hit=0.5)
    assert policy.best() is True


def test_overlap_policy_is_not_swayed_by_rounds_that_ingest_more_tokens():
    """On Strix Halo's Vulkan a round whose slots lag a little more crosses the 8-token
    edge and costs ~200 ms more, whether or not the drafter drafted ahead beside it.
    Compared at equal prompt tokens those rounds say nothing about the overlap's cost,
    and drafting ahead (which costs verification nothing here) stays on."""
    policy = OverlapPolicy("auto")
    rng = np.random.default_rng(3)
    choices = []
    for _ in range(600):
        ahead = policy.decide(True)
        choices.append(ahead)
        large = rng.random() < 0.1
        verify = 110.0 + (200.0 if large else 0.0) + rng.normal(0, 1)
        next_draft = 0.2 if ahead and rng.random() < 0.5 else 11.0
        policy.observe(
            RoundRecord(1, 0, 1, 0.0, verify, 0.0, drafted_ahead=ahead, next_drafted=1,
                        next_draft_ms=next_draft, server_prompt_tokens=9 if large else 4)
        )  # fmt: skip
    assert policy.best() is True
    later = choices[100:]
    assert later.count(False) <= len(later) / 16


def test_overlap_policy_fixed_modes():
    assert all(OverlapPolicy("on").decide(True) for _ in range(20))
    assert not any(OverlapPolicy("off").decide(True) for _ in range(20))
    assert OverlapPolicy("auto").decide(False) is False  # the drafter cannot draft ahead
    with pytest.raises(ValueError):
        OverlapPolicy("sometimes")  # type: ignore[arg-type]


def learned_policy(verify_ms: dict[int, float]) -> DraftLengthPolicy:
    """A policy that has seen rounds of every length 1..6, each with these verify
    costs, a draft that is calibrated (accepted = its own expectation) and 2 ms a
    token, on a slow target (a round ~170 ms, as on an integrated GPU)."""
    policy = DraftLengthPolicy(6, rule="marginal")
    for n in (1, 2, 3, 4, 5, 6) * 4:
        expected = sum(0.9**i for i in range(1, n + 1))
        policy.observe(
            steady_round([0.9] * n, round(expected), round(expected) + 1, 2.0 * n,
                       verify_ms[n], 170.0)
        )  # fmt: skip
    return policy


STEP = {1: 95.0, 2: 100.0, 3: 160.0, 4: 163.0, 5: 166.0, 6: 170.0}  # batch > 8 tokens
LINEAR = {n: 95.0 + 15.0 * (n - 1) for n in range(1, 7)}  # same ends, no step


def test_policy_charges_each_length_what_it_measured():
    step, linear = learned_policy(STEP), learned_policy(LINEAR)
    assert [step.verify_ms_for_draft(m) for m in range(2, 7)] == pytest.approx(
        [5.0, 60.0, 3.0, 3.0, 4.0]
    )
    assert [linear.verify_ms_for_draft(m) for m in range(2, 7)] == pytest.approx([15.0] * 5)
    # a fair draft stops before the step that a linear cost model would walk into
    assert drafted_length(step, 0.8) == 2
    assert drafted_length(linear, 0.8) > 2
    # a near-certain draft repays the step with the cheap positions after it (look-ahead)
    assert drafted_length(step, 0.97) == 6


def test_policy_without_per_length_samples_uses_the_slope():
    policy = DraftLengthPolicy(8, rule="marginal")
    for k in (2, 4, 6, 8) * 2:  # two rounds of each length: not enough to trust a mean
        policy.observe(steady_round([0.9] * k, 1, 2, 4.0, 10.0 + 2.5 * k, 40.0))
    assert policy.verify_ms_for_draft(4) == pytest.approx(policy.verify_slope_ms())


# -- the formula rule: k maximising E(k) / T(k) -------------------------------------

# verify ms per k, measured once on the H200 (14B f16, 512 tokens): a realistic shape
H200_512 = {1: 17.9, 2: 20.1, 3: 22.1, 4: 23.7, 5: 24.4, 6: 25.0}


def formula_policy(
    verify_ms: dict[int, float],
    a: float,
    token_ms: float,
    resync_ms: float,
    proxy_ms: float = 0.0,
    k_max: int = 6,
    rule: str = "uniform",
) -> DraftLengthPolicy:
    """A formula policy that measured these costs: rounds of every length whose drafts
    were accepted at rate a (each round: its accepted drafts and one rejection, in
    proportions that give S / (S + F) = a), half of them re-synced."""
    policy = DraftLengthPolicy(k_max, rule=rule)
    for n in list(verify_ms) * 4:
        for accepted in (n, n - 1):  # one fully accepted, one rejected round per length
            policy.observe(
                steady_round([1.0] * n, accepted, accepted + 1, resync_ms + n * token_ms,
                           verify_ms[n], 0.0, fresh_tokens=n, fresh_ms=n * token_ms,
                           resynced=True, overhead_ms=proxy_ms)
            )  # fmt: skip
    # the acceptance itself: from rounds whose counts give exactly a (weights 1 : 1)
    policy._successes, policy._failures = a, 1.0 - a
    policy._best = policy._two = None
    return policy


def brute_force_k(
    verify_ms: dict[int, float],
    a: float,
    t_d: float,
    t_resync: float,
    ahead: bool,
    proxy_ms: float = 0.0,
) -> int:
    """argmax_k E(k) / T(k) written out from the issue's formula."""

    def rate(k: int) -> float:
        e = (1 - a ** (k + 1)) / (1 - a)
        if ahead:
            t = (
                verify_ms[k]
                + proxy_ms
                + a ** (k + 1) * max(0.0, (k + 1) * t_d - verify_ms[k])
                + (1 - a ** (k + 1)) * (t_resync + k * t_d)
            )
        else:
            t = verify_ms[k] + proxy_ms + t_resync + k * t_d
        return e / t

    return max(sorted(verify_ms), key=lambda k: (rate(k), -k))


@pytest.mark.parametrize(
    ("a", "t_d", "t_resync", "proxy_ms"),
    [(0.77, 2.0, 0.5, 1.0), (0.77, 0.0, 0.0, 0.0), (0.5, 4.0, 1.0, 2.0), (0.9, 11.0, 1.0, 0.5),
     (0.3, 2.0, 0.5, 1.0), (0.77, 25.0, 2.0, 1.0)],
)  # fmt: skip
@pytest.mark.parametrize("ahead", [True, False])
def test_formula_length_is_the_argmax_of_expected_tokens_per_round_time(
    a, t_d, t_resync, proxy_ms, ahead
):
    policy = formula_policy(H200_512, a, t_d, t_resync, proxy_ms)
    assert policy.acceptance_rate() == pytest.approx(a)
    assert policy.token_ms == pytest.approx(t_d)
    assert policy.resync_ms == pytest.approx(t_resync)
    assert policy.length(ahead) == brute_force_k(H200_512, a, t_d, t_resync, ahead, proxy_ms)


def test_a_fast_drafter_that_drafts_ahead_is_not_held_at_one_draft():
    """H200 14B f16 at 512, a = 0.77: a drafter at 2 ms a token (0.2 steps) drafts 3
    (E/T: 94, 105, 108, 107, 106, 103 tok/s for k = 1..6); drafting ahead never asks
    for fewer drafts than serial drafting, and at 6 ms a token it asks for more."""
    fast = formula_policy(H200_512, 0.77, 2.0, 0.3)
    assert fast.length(ahead=True) == 3
    assert all(fast.worth(m, 0.01) for m in range(1, 4))  # no per-position cut on top
    for t_d in (0.5, 2.0, 4.0, 6.0, 8.0, 11.0):
        policy = formula_policy(H200_512, 0.77, t_d, 0.3)
        assert policy.length(ahead=True) >= policy.length(ahead=False)
    slower = formula_policy(H200_512, 0.77, 6.0, 0.3)
    assert (slower.length(ahead=True), slower.length(ahead=False)) == (2, 1)


@pytest.mark.parametrize("ahead", [True, False])
def test_speedup_at_an_acceptance_is_the_cost_models_best_rate_against_the_baselines(ahead):
    """What the plain-run gate scales its measured speculation rate by: max over k of
    E(k, a) / T(k, a), against the same at the acceptance the rate was measured at
    (the drafter's costs as measured; the hidden share of drafting depends on a)."""
    policy = formula_policy(H200_512, 0.5, 2.0, 0.3)
    assert DraftLengthPolicy(6).speedup_at(0.9, 0.5) is None  # nothing measured
    policy.best_length(ahead)  # the rounds' mode of drafting, as the engine asks

    def best_rate(a: float) -> float:
        k = brute_force_k(H200_512, a, 2.0, 0.3, ahead)
        e = (1 - a ** (k + 1)) / (1 - a)
        t = H200_512[k] + (
            a ** (k + 1) * max(0.0, (k + 1) * 2.0 - H200_512[k])
            + (1 - a ** (k + 1)) * (0.3 + k * 2.0)
            if ahead
            else 0.3 + k * 2.0
        )
        return e / t

    for a, baseline in [(0.9, 0.5), (0.2, 0.5), (0.9, 0.7), (0.5, 0.9)]:
        expected = best_rate(a) / best_rate(baseline)
        assert policy.speedup_at(a, baseline) == pytest.approx(expected)
    assert policy.speedup_at(0.9, 0.5) > 1.5 and policy.speedup_at(0.2, 0.5) < 1.0
    assert policy.acceptance_rate() == pytest.approx(0.5)  # asking changes nothing


def test_formula_waits_for_measurements_and_respects_fixed_k():
    policy = DraftLengthPolicy(6)
    assert policy.length(True) == 6
    fixed = DraftLengthPolicy(6, adaptive=False)
    for _ in range(10):
        fixed.observe(steady_round([1.0] * 6, 0, 1, 10.0, 20.0, 30.0))
    assert fixed.length(True) == 6
    marginal = formula_policy(H200_512, 0.3, 20.0, 1.0)
    marginal.rule = "marginal"
    assert marginal.length(True) == 6  # the marginal rule cuts per position instead
    with pytest.raises(ValueError):
        DraftLengthPolicy(6, rule="sometimes")  # type: ignore[arg-type]


def test_acceptance_counts_rejections_not_draft_lengths():
    """Rounds of 4 drafts accepting 2 then rejecting: a = 2 / 3, where accepted/drafted
    would say 0.5."""
    policy = DraftLengthPolicy(4)
    for _ in range(20):
        policy.observe(steady_round([1.0] * 4, 2, 3, 4.0, 20.0, 30.0))
    assert policy.acceptance_rate() == pytest.approx(2 / 3)


# -- the engine: the next round's draft starts when the verify result is back --------


class ScriptSession(CountingSession):
    """Drafts a fixed script (wrong at some positions) and records, for every token it
    drafts, how many tokens the consumer had taken from the engine by then."""

    def __init__(self, script: list[int], n_prompt: int, wrong_at: set[int], seen: list[int]):
        super().__init__(prob=1.0)
        self.script, self.n_prompt, self.wrong_at, self.seen = script, n_prompt, wrong_at, seen
        self.drafted_at: list[tuple[int, int]] = []  # (sequence length, tokens consumed)
        self.synced_at: list[tuple[int, int]] = []

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        self.synced_at.append((len(tokens), self.seen[0]))
        return super().sync(tokens)

    def propose(self, k, sampling=GREEDY, rng=None, cancel=None) -> Draft:
        draft = Draft()
        for _ in range(k):
            if cancel is not None and cancel.cancelled:
                break
            position = len(self._tokens) - self.n_prompt
            if position >= len(self.script):
                break
            self.drafted_at.append((len(self._tokens), self.seen[0]))
            token = self.script[position] + (1000 if position in self.wrong_at else 0)
            self._tokens.append(token)
            draft.tokens.append(token)
            draft.probs.append(1.0)
        return draft


async def _run_engine(
    early: bool,
    overlap: bool,
    consumer_sleep_s: float = 0.0,
    send_ahead: bool | None = None,
    calls_seen: list[int] | None = None,
):
    """`send_ahead` None: the one-decode check on (which rules sending ahead out);
    `calls_seen`: the verify requests sent by the time each token was taken."""
    from proxy.engine import EngineSettings, Generation, GenerationParams
    from proxy.engine.server_text import PieceCache
    from tests.proxy.test_units import FakeUpstream

    script = list(range(100, 140))
    seen = [0]
    session = ScriptSession(script, 2, {3, 9, 10, 17}, seen)
    upstream = FakeUpstream(script)
    settings = EngineSettings(
        k=3, overlap="auto" if overlap else "off", early_draft=early,
        strict_decodes=send_ahead is None, send_ahead=bool(send_ahead),
    )  # fmt: skip
    generation = Generation(
        upstream, [1, 2], GenerationParams(n_predict=30), 1000, AsyncSessionDrafter(session),
        PieceCache(upstream), settings=settings,
    )  # fmt: skip
    tokens = []
    async for event in generation.run():
        tokens.append(event.token)
        if calls_seen is not None:
            calls_seen.append(len(upstream.calls))
        seen[0] += 1
        if consumer_sleep_s:
            await asyncio.sleep(consumer_sleep_s)  # a slow client: the proxy's own work
    if calls_seen is not None:
        calls_seen.append(len(upstream.calls))  # and all told
    return script, tokens, generation.result, session


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
async def test_engine_output_is_the_servers_with_or_without_early_drafts(early, overlap):
    script, tokens, result, _ = await _run_engine(early, overlap)
    assert tokens == script[:30]
    assert sum(r.n_committed for r in result.rounds) == 30
    assert any(r.n_accepted < r.n_drafted for r in result.rounds)  # misses happened


async def test_early_draft_drafts_the_next_round_while_the_last_is_committed():
    """With a slow consumer, the drafter re-syncs to a round's committed sequence while
    the consumer is still taking that round's tokens (early draft); without it, only
    once the consumer has taken them all."""
    n_prompt = 2
    _, _, _, session = await _run_engine(True, False, consumer_sleep_s=0.02)
    assert any(consumed < n - n_prompt for n, consumed in session.synced_at), session.synced_at
    _, _, _, session = await _run_engine(False, False, consumer_sleep_s=0.02)
    assert len(session.synced_at) > 3
    assert all(consumed == n - n_prompt for n, consumed in session.synced_at)


@pytest.mark.parametrize("send_ahead", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
async def test_rounds_sent_ahead_write_the_servers_output_and_go_out_before_streaming(
    send_ahead, overlap
):
    """Sending ahead, the next round's verify request goes out before the consumer takes
    the last round's first token (and its record says so), except after the first round
    and the round after it (whose slots catch up) and at the end of the text (no request
    is wasted); the output is the server's either way, misses included."""
    calls: list[int] = []
    script, tokens, result, _ = await _run_engine(True, overlap, 0.002, send_ahead, calls)
    assert tokens == script[:30]
    assert calls[-1] == len(result.rounds)
    assert not any(r.sent_ahead for r in result.rounds[:2])
    assert any(r.n_accepted < r.n_drafted for r in result.rounds)
    first_token, ahead = 0, []
    for index, record in enumerate(result.rounds):
        # round `index` is the (index+1)-th verify request; one more went out before its
        # first token was taken where the next round was sent ahead
        ahead.append(calls[first_token] - (index + 1))
        first_token += record.n_committed
    assert all(n in (0, 1) for n in ahead), ahead
    sent = [r.sent_ahead for r in result.rounds]
    assert sent[1:] == [n == 1 for n in ahead[:-1]]
    if send_ahead:
        assert sum(ahead) >= len(result.rounds) // 2, ahead
    else:
        assert not any(ahead) and not any(sent)


async def test_log_rounds_writes_one_json_line_per_round_with_its_slots(caplog):
    """`--log-rounds`: one JSON line per speculative round, and per prompt its slot,
    the tokens it ingested and found cached, matching the round's record."""
    from proxy.engine.rounds import ROUND_LOG

    with caplog.at_level(logging.DEBUG, logger=ROUND_LOG):
        _, _, result, _ = await _run_engine(True, True, send_ahead=True)
    lines = [json.loads(r.getMessage().removeprefix("round ")) for r in caplog.records
             if r.name == ROUND_LOG]  # fmt: skip
    assert len(lines) == len(result.rounds)
    for line, record in zip(lines, result.rounds, strict=True):
        assert line["n_drafted"] == record.n_drafted
        assert line["n_accepted"] == record.n_accepted
        assert line["sent_ahead"] == record.sent_ahead
        assert len(line["slots"]) == record.n_drafted + 1  # one prompt per draft prefix
        assert sum(s[1] for s in line["slots"]) == record.server_prompt_tokens
    assert any(line["sent_ahead"] for line in lines)


async def test_rounds_are_not_logged_without_log_rounds(caplog):
    from proxy.engine.rounds import ROUND_LOG

    with caplog.at_level(logging.INFO):
        await _run_engine(True, True, send_ahead=True)
    assert not [r for r in caplog.records if r.name == ROUND_LOG]


def brute_force_two_lengths(
    verify_ms: dict[int, float], a: float, t_d: float, t_resync: float, proxy_ms: float
) -> tuple[int, int]:
    """The two-state chain written out: rounds in R (drafts ready) and M (fresh)."""
    e = {k: (1 - a ** (k + 1)) / (1 - a) for k in verify_ms}
    best, best_rate = None, -1.0
    for k_r in sorted(verify_ms):
        for k_m in sorted(verify_ms):
            stay, back = a ** (k_r + 1), a ** (k_m + 1)  # P(next in R | R), P(next in R | M)
            share_r = back / (1 - stay + back)  # stationary share of rounds in R
            late_r = stay * max(0.0, (k_r + 1) * t_d - verify_ms[k_r])
            late_m = back * max(0.0, (k_r + 1) * t_d - verify_ms[k_m])
            time_r = proxy_ms + verify_ms[k_r] + late_r
            time_m = proxy_ms + verify_ms[k_m] + max(0.0, t_resync + k_m * t_d) + late_m
            rate = (share_r * e[k_r] + (1 - share_r) * e[k_m]) / (
                share_r * time_r + (1 - share_r) * time_m
            )
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (k_r, k_m), rate
    assert best is not None
    return best


@pytest.mark.parametrize(
    ("a", "t_d", "t_resync", "proxy_ms"),
    [(0.77, 2.5, 0.5, 1.0), (0.77, 1.1, 0.3, 0.5), (0.77, 5.0, 0.5, 1.0), (0.5, 4.0, 1.0, 2.0),
     (0.9, 11.0, 1.0, 0.5), (0.3, 2.0, 0.5, 1.0)],
)  # fmt: skip
def test_two_lengths_are_the_argmax_of_the_two_state_rate(a, t_d, t_resync, proxy_ms):
    policy = formula_policy(H200_512, a, t_d, t_resync, proxy_ms, rule="formula")
    expected = brute_force_two_lengths(H200_512, a, t_d, t_resync, proxy_ms)
    assert (policy.length(ahead=True), policy.fresh_length(ahead=True)) == expected
    # serial drafting has one state: the one-length formula
    assert policy.length(ahead=False) == policy.fresh_length(ahead=False)
    assert policy.length(False) == brute_force_k(H200_512, a, t_d, t_resync, False, proxy_ms)


def test_two_lengths_draft_few_fresh_and_many_ready_for_a_slowish_drafter():
    """H200 14B f16 at 512, a = 0.77, drafter at 2.5 ms a token (X = 0.27): six drafts
    where they are ready, one where they must be drafted fresh (~114 tok/s by the
    model, against ~105 for the best single length, k = 3)."""
    policy = formula_policy(H200_512, 0.77, 2.5, 0.0, rule="formula")
    assert (policy.length(True), policy.fresh_length(True)) == (6, 1)
    assert formula_policy(H200_512, 0.77, 2.5, 0.0).length(True) == 3  # uniform


async def test_a_round_without_drafts_ready_drafts_at_most_k_fresh():
    session = CountingSession()
    drafter = AsyncSessionDrafter(session)
    committed = [1, 2, 3]
    try:
        first = await drafter.draft(committed, 4, always, 1)  # nothing drafted ahead
        assert first.tokens == expected_draft(committed, 1) and first.resynced
        assert await drafter.extend(5, CancelToken()) == 5
        line = committed + first.tokens
        line.append(next_token(line))  # accepted, bonus = the drafter's guess
        second = await drafter.draft(line, 4, always, 1)  # drafts ready: up to 4
        assert second.tokens == expected_draft(line, 4) and second.reused == 4
    finally:
        await drafter.close()


async def test_the_guard_passes_k_fresh_on():
    """The proxy bounds every drafter call (proxy.drafter_guard): a draft with the
    fresh-length argument must pass the guard, or the first round using it would drop
    the drafter."""
    from proxy.drafter_guard import DrafterSupervisor

    supervisor = DrafterSupervisor(lambda: AsyncSessionDrafter(CountingSession()))
    drafter = await supervisor.open()
    assert drafter is not None

    def tokens(draft: GreedyDraft) -> list[int]:
        return draft.tokens

    try:
        call = drafter.draft([1, 2, 3], 4, always, 1)
        draft = await supervisor.bounded(call, 4, tokens)
        assert draft.tokens == expected_draft([1, 2, 3], 1)
        call = drafter.draft([5, 6], 3, always)
        assert (await supervisor.bounded(call, 3, tokens)).tokens == expected_draft([5, 6], 3)
        assert supervisor.failures == 0
    finally:
        await drafter.close()


# -- the round timeline ---------------------------------------------------------------


async def test_round_timeline_adds_up_and_sees_the_drafter_work_during_verification():
    """Verify takes 30 ms; the drafter 8 ms a token. Without drafting ahead the drafter
    idles through every verification; with it (4 tokens = 32 ms to draft ahead) it is
    busy for nearly all of it. The server's idle gap holds the round's draft wait."""
    from proxy.engine import EngineSettings, Generation, GenerationParams
    from proxy.engine.server_text import PieceCache
    from proxy.metrics import ProxyMetrics
    from tests.proxy.test_units import FakeUpstream

    class SlowUpstream(FakeUpstream):
        async def verify(self, context, draft, pad=()):
            await asyncio.sleep(0.03)
            return await super().verify(context, draft, pad)

    class SlowSession(ScriptSession):
        def propose(self, k, sampling=GREEDY, rng=None, cancel=None) -> Draft:
            import time

            time.sleep(0.008 * k)  # a drafter of 8 ms a token, off the event loop
            return super().propose(k, sampling, rng, cancel)

    script = list(range(100, 140))
    idle = {}
    for overlap in (False, True):
        upstream = SlowUpstream(script)
        metrics = ProxyMetrics()
        settings = EngineSettings(k=3, adaptive=False, overlap="on" if overlap else "off")
        session = SlowSession(script, 2, set(), [0])
        generation = Generation(
            upstream, [1, 2], GenerationParams(n_predict=24), 1000,
            AsyncSessionDrafter(session), PieceCache(upstream), observer=metrics,
            settings=settings,
        )  # fmt: skip
        assert [e.token async for e in generation.run()] == script[:24]
        rounds = generation.result.rounds
        for r in rounds:
            assert r.draft_ready_ms <= r.verify_sent_ms <= r.verify_back_ms
            assert r.verify_back_ms - r.verify_sent_ms == pytest.approx(r.verify_ms, abs=0.5)
            assert 0.0 <= r.drafter_idle_ms <= r.verify_ms
            assert r.server_idle_ms >= r.draft_ms - 0.5  # the draft wait is server idle time
        idle[overlap] = sum(r.drafter_idle_ms for r in rounds) / sum(r.verify_ms for r in rounds)
        assert metrics.server_idle_ms.n == metrics.drafter_idle_ms.n == len(rounds)
        assert "npu_spec_server_idle_ms_sum" in metrics.render()
    assert idle[False] == pytest.approx(1.0)
    assert idle[True] < 0.2


# -- measuring the lengths the formula has not sent ----------------------------------

# verify ms per k where every prompt token costs (a CPU): the k+1-prompt batch grows as
# k^2, much faster than the prior slope of 1 ms per draft
STEEP = {1: 10.0, 2: 12.0, 3: 17.0, 4: 23.0, 5: 30.0, 6: 38.0}


def play(
    policy: DraftLengthPolicy, rounds: int, verify_ms: dict[int, float], a: float
) -> list[int]:
    """Rounds at the lengths the policy asks for, accepted at rate a (alternating full
    and one-short acceptances that give S / (S + F) = a over a pair), free drafting."""
    sent = []
    for i in range(rounds):
        k, _fresh = policy.decide(True)
        sent.append(k)
        accepted = k if i % 2 else max(k - 1, 0)
        policy.observe(
            steady_round([1.0] * k, accepted, accepted + 1, 0.0, verify_ms[k], verify_ms[k],
                         fresh_tokens=k, fresh_ms=0.0, resynced=True)
        )  # fmt: skip
    return sent


def test_the_formula_sweeps_every_length_then_explores_beside_its_choice():
    from proxy.policies.draft_length import _EXPLORE_EVERY, _MIN_ROUNDS, _SWEEP_SAMPLES

    policy = DraftLengthPolicy(6)
    sent = play(policy, 400, STEEP, 0.77)
    # from the first round, the shortest lengths first, each _SWEEP_SAMPLES times
    sweep_end = _MIN_ROUNDS + _SWEEP_SAMPLES * 6
    sweep = sent[:sweep_end]
    assert sweep[: 2 * _SWEEP_SAMPLES] == [1] * _SWEEP_SAMPLES + [2] * _SWEEP_SAMPLES
    # measured, a steep cost curve asks for short rounds; without the sweep only k = 6
    # would be known and the prior slope would keep the policy there
    policy._successes, policy._failures = 0.77, 0.23
    policy._best = policy._two = None
    chosen = policy.length(True)
    assert chosen == max(STEEP, key=lambda k: ((1 - 0.77 ** (k + 1)) / 0.23) / STEEP[k])
    assert all(sweep.count(n) >= _SWEEP_SAMPLES for n in range(1, chosen + 2))
    later = sent[sweep_end:]
    explored = [
        k for i, k in enumerate(later) if k != later[i - 1] and k != later[(i + 1) % len(later)]
    ]
    # neighbours that lose much are tried less often than every _EXPLORE_EVERY rounds
    assert explored and len(explored) < len(later) // _EXPLORE_EVERY
    settled = later[later.index(chosen) :]
    assert all(abs(k - chosen) == 1 for k in settled if k != chosen)


# Strix Halo 32B's Vulkan rounds: a k = 2 round costs twice a k = 1 round (its 9-token
# rounds cross the 8-token matrix-vector edge) and every draft beyond costs ~115 ms more
CLIFF = {1: 112.0, 2: 226.0, 3: 340.0, 4: 410.0, 5: 480.0, 6: 560.0}


def test_the_sweep_stops_going_longer_past_a_cost_cliff():
    from proxy.policies.draft_length import _SWEEP_SAMPLES

    policy = DraftLengthPolicy(6)
    sent = play(policy, 200, CLIFF, 0.8)
    assert sent[: 2 * _SWEEP_SAMPLES] == [1] * _SWEEP_SAMPLES + [2] * _SWEEP_SAMPLES
    # k = 2 loses over a third of k = 1's rate: nothing longer is swept, and the curve
    # past it is extrapolated along the measured segment, not by a prior slope
    assert max(sent[: 6 * _SWEEP_SAMPLES]) == 2
    assert policy.verify_ms_at(4) == pytest.approx(CLIFF[2] + 2 * (CLIFF[2] - CLIFF[1]), rel=0.05)
    assert policy.length(True) == 1
    assert sum(k >= 3 for k in sent) == 0
    assert sent[-50:].count(1) >= 45  # settled, with rare tries of k = 2


def test_the_verify_curve_interpolates_between_measured_lengths():
    policy = DraftLengthPolicy(6)
    for k, ms in ((1, 10.0), (1, 10.0), (4, 40.0), (4, 40.0)):
        policy.observe(steady_round([1.0] * k, k, k + 1, 0.0, ms, ms, fresh_tokens=k,
                                    fresh_ms=0.0, resynced=True))  # fmt: skip
    assert policy.verify_ms_at(2) == pytest.approx(20.0)
    assert policy.verify_ms_at(6) == pytest.approx(60.0)


def test_a_neighbour_that_loses_much_is_explored_less_often():
    policy = DraftLengthPolicy(6)
    play(policy, 60, STEEP, 0.77)
    policy._successes, policy._failures = 0.77, 0.23
    policy._best = policy._two = None
    chosen = policy.length(True)
    assert policy._explore_spacing(True, chosen, chosen) == 1
    near, far = (
        policy._explore_spacing(True, chosen, chosen + 1),
        policy._explore_spacing(True, chosen, 6),
    )
    assert 1 <= near < far <= 16


def test_a_neighbour_whose_rounds_wait_for_slot_copies_is_explored_less_often():
    # Strix Halo 14B chats: a try of k = 2 first restored a saved copy into the slot it
    # uses (129-237 ms against ~60 ms rounds), about once a turn
    from proxy.policies.draft_length import _EXPLORE_SETUP_SPACING_MAX, _EXPLORE_SPACING_MAX

    def tries_after_sweep(copy_ms: float) -> int:
        policy = DraftLengthPolicy(6)
        sent, copied = [], False
        for i in range(3000):
            k, _fresh = policy.decide(True)
            sent.append(k)
            # a try copies first (a catch-up round, sent again), then is measured
            copied = policy.exploring_now() and i > 100 and not copied and copy_ms > 0
            accepted = k if i % 2 else max(k - 1, 0)
            policy.observe(
                steady_round([1.0] * k, accepted, accepted + 1, 0.0, CLIFF[k], CLIFF[k],
                             fresh_tokens=k, fresh_ms=0.0, resynced=True, catch_up=copied,
                             draft_ready_ms=0.0, verify_sent_ms=copy_ms if copied else 0.0)
            )  # fmt: skip
        return sum(k != 1 for k in sent[100:])

    free, waiting = tries_after_sweep(0.0), tries_after_sweep(2 * CLIFF[1])
    assert free > 0 and waiting > 0  # still measured now and then
    assert waiting * 2 < free
    assert _EXPLORE_SPACING_MAX < _EXPLORE_SETUP_SPACING_MAX


def test_a_fixed_length_never_explores():
    policy = DraftLengthPolicy(6, adaptive=False)
    assert set(play(policy, 60, STEEP, 0.77)) == {6}


# -- timing the drafter beside a plain run -------------------------------------------


class SlowSyncSession(CountingSession):
    """Takes `sync_s` to take in a prompt (a long context on a slow drafter)."""

    def __init__(self, sync_s: float) -> None:
        super().__init__()
        self.sync_s = sync_s
        self.closed = False

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        import time

        time.sleep(self.sync_s)
        return super().sync(tokens)

    def close(self) -> None:
        self.closed = True


def _proposer(drafter: AsyncSessionDrafter | None, tasks: BackgroundTasks) -> Proposer:
    """A greedy generation's proposer that drafts every position (fixed length 4)."""
    policies = EngineSettings(k=4, adaptive=False).policies().for_request(None)
    return Proposer(drafter, policies, background=tasks)


async def test_a_timing_draft_reports_even_after_its_generation_ended_without_holding_it():
    """The drafter's speed reaches the gate when its timing draft is done, also where the
    generation ended first; ending the generation does not wait for the drafter."""
    import time

    tasks = BackgroundTasks()  # the proxy's, shared by its generations
    session = SlowSyncSession(sync_s=0.4)
    source = _proposer(AsyncSessionDrafter(session), tasks)
    reported: list[float] = []
    before = time.perf_counter()
    assert not source.busy_since(before)
    source.time_drafter(list(range(50)), 4, reported.append)
    await asyncio.sleep(0.05)  # the plain runs of a short answer
    assert source.busy_since(time.perf_counter())  # a plain run now is no plain speed
    started = time.perf_counter()
    await source.close()
    assert time.perf_counter() - started < 0.2  # the response is not held
    assert not reported and not session.closed
    # the next generation's plain runs: the closing session still works beside them
    assert _proposer(None, tasks).busy_since(time.perf_counter())
    for _ in range(100):
        if session.closed:
            break
        await asyncio.sleep(0.02)
    assert len(reported) == 1 and reported[0] >= 0.0  # ms per drafted token
    assert session.closed  # and the session was closed after it
    await asyncio.wait_for(tasks.wait(), 5)  # the closing task's own end
    assert source.busy_since(before) and not source.busy_since(time.perf_counter())
    assert not _proposer(None, tasks).busy_since(time.perf_counter())


async def test_a_draft_waits_for_the_timing_draft_and_reuses_its_line():
    session = CountingSession()
    source = _proposer(AsyncSessionDrafter(session), BackgroundTasks())
    reported: list[float] = []
    committed = list(range(20))
    source.time_drafter(committed, 3, reported.append)
    draft, _dists, _ms = await source.draft(committed, 3)
    assert draft.tokens == expected_draft(committed, 3)
    assert draft.reused == 3 and session.computed == 3  # the timing draft's tokens
    assert len(reported) == 1
    await source.close()


async def test_a_shadow_draft_runs_alone_on_the_session_and_only_for_greedy_requests():
    """A draft beside a plain run is the next draft's line (it waits for it); none starts
    while another draft of the session runs, nor for a sampling request."""
    import time

    session = SlowSyncSession(sync_s=0.2)
    source = _proposer(AsyncSessionDrafter(session), BackgroundTasks())
    committed = list(range(30))
    shadow = source.shadow_draft(committed, 3)
    assert shadow is not None
    assert source.shadow_draft(committed, 3) is None  # the first still takes in the prompt
    await asyncio.sleep(0.05)
    assert source.busy_since(time.perf_counter())  # the run beside it is no plain speed
    drafted, _dists, _ms = await shadow
    assert drafted.tokens == expected_draft(committed, 3)
    draft, _dists, _ms = await source.draft(committed, 3)
    assert draft.reused == 3 and session.computed == 3  # the shadow draft's tokens
    await source.prepare(committed + draft.tokens + [5], 3)  # a round's early draft
    assert source.shadow_draft(committed, 3) is None
    await source.close()
    sampled = Proposer(
        AsyncSessionDrafter(CountingSession()),
        EngineSettings(k=4).policies().for_request(None),
        sampled=SampledDrafts(GREEDY, np.random.default_rng(0)),
    )
    assert sampled.shadow_draft(committed, 3) is None
    await sampled.close()


# the H200 at 4k (14B f16, wall ms of a verify round by k): every length costs
# ~14 ms a committed token even with free drafts, against a 9.7 ms plain step
H200_4K = {1: 24.8, 2: 33.2, 3: 40.0, 4: 45.0, 5: 50.0, 6: 55.0}


def test_the_free_drafter_ceiling_waits_for_the_sweep_then_takes_the_best_length():
    policy = DraftLengthPolicy(6)
    play(policy, 4, STEEP, 0.77)  # k = 1 and 2 measured; 3 to 6 not yet
    assert policy.ceiling_ms_per_token() is None
    play(policy, 40, STEEP, 0.77)
    a = policy.optimistic_acceptance()
    assert a is not None and a > policy.acceptance_rate()  # taken high: it rules out
    e = {k: (1 - a ** (k + 1)) / (1 - a) for k in STEEP}
    measured = {k: v for k, (v, c) in policy._by_length.items() if c >= 2}
    assert policy.ceiling_ms_per_token() == pytest.approx(
        min(v / e[k] for k, v in measured.items())
    )


def test_the_gate_chooses_plain_runs_once_even_free_drafts_lose():
    """On the H200 at 4k the gate chose plain runs only from steady rounds at the
    formula's length, after the sweep's 15 exploring rounds: the next request still
    speculated, at 0.43x plain. With the ceiling it decides once the sweep is over."""
    from proxy.engine import RoundRecord
    from proxy.policies import SharedPolicies

    for verify, plain_ms, chosen in ((H200_4K, 9.7, True), (STEEP, 9.7, False)):
        shared = SharedPolicies.build(6, plain_runs="auto")
        policies = shared.for_request(None)
        gate = policies.plain_runs
        assert gate is not None and gate.decide() == gate.run_tokens
        n = gate.run_tokens
        policies.observe(RoundRecord(0, 0, n, 0.0, n * plain_ms, 0.0, plain_run=True,
                                     n_run_tokens=n))  # fmt: skip
        gate.observe_drafter(0.5)
        draws = random.Random(7)
        for _ in range(20):  # the sweep's rounds: only the ceiling can decide in them
            k, _ = policies.draft_length.decide(True)
            accepted = 0  # drafts accepted in turn at a = 0.77, as the oracle does
            while accepted < k and draws.random() < 0.77:
                accepted += 1
            policies.observe(
                steady_round([1.0] * k, accepted, accepted + 1, 0.0, verify[k], verify[k],
                             fresh_tokens=k, fresh_ms=0.0, resynced=True)
            )  # fmt: skip
        assert gate.plain_chosen is chosen, (verify, gate.snapshot())


def test_rounds_without_a_draft_count_as_speculation_for_the_gate():
    """A drafter that yields nothing (a request off the oracle's path; an n-gram
    drafter without a match) sends one-prompt rounds. The draft-length policy counts no
    such round, so the round index it chose to explore stayed "exploring" and the gate
    never judged them: on the H200 at 4k a warm-up ran ~100 of them (~29 ms a token
    against a 9.7 ms step) and chose nothing. The gate must choose plain runs."""
    from proxy.engine import RoundRecord
    from proxy.policies import SharedPolicies

    policies = SharedPolicies.build(6, plain_runs="auto").for_request(None)
    gate = policies.plain_runs
    assert gate is not None and gate.decide() == gate.run_tokens
    n = gate.run_tokens
    policies.observe(RoundRecord(0, 0, n, 0.0, n * 9.7, 0.0, plain_run=True, n_run_tokens=n))
    gate.observe_drafter(0.5)
    for _ in range(12):
        k, _ = policies.draft_length.decide(True)
        assert k >= 1  # the policy asked for drafts; the drafter had none
        policies.observe(RoundRecord(0, 0, 1, 0.1, 13.0, 0.4, round_ms=13.5))
    assert gate.plain_chosen, gate.snapshot()


def test_the_ceiling_does_not_rule_out_on_a_few_unlucky_rounds():
    """On the Strix Halo 14B file (emulated) the ceiling, from the point estimate after
    7 rounds with 2 of 8 drafts accepted (a = 0.8 drawn), ruled speculation out at 45 ms
    a token against a 42 ms step; speculating ran 1.16x plain. The ceiling waits for
    enough judged drafts and takes the acceptance high; the same unlucky start, then
    rounds at the drawn acceptance, keeps speculating."""
    from proxy.engine import RoundRecord
    from proxy.policies import SharedPolicies

    strix_14b = {1: 47.0, 2: 55.0, 3: 140.0, 4: 150.0}  # a cliff past 8 tokens
    policies = SharedPolicies.build(4, plain_runs="auto").for_request(None)
    gate = policies.plain_runs
    assert gate is not None
    n = gate.run_tokens
    policies.observe(RoundRecord(0, 0, n, 0.0, n * 42.0, 0.0, plain_run=True, n_run_tokens=n))
    gate.observe_drafter(11.0)
    unlucky = [0, 0, 1, 0, 1, 0, 0]  # 2 accepted in 7 rounds
    lucky = [1, 2, 2, 1, 2, 2, 0, 2, 1, 2, 2, 2]
    for i, accepted in enumerate(unlucky + lucky):
        k, _ = policies.draft_length.decide(True)
        accepted = min(accepted, k)
        policies.observe(
            steady_round([0.8] * k, accepted, accepted + 1, 0.0, strix_14b[k], strix_14b[k],
                         fresh_tokens=k, fresh_ms=11.0 * k, resynced=True)
        )  # fmt: skip
        if i < len(unlucky):
            assert policies.draft_length.ceiling_ms_per_token() is None  # too few judged
    assert not gate.plain_chosen, gate.snapshot()
