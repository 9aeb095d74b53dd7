"""Runner-up lines: pre-drafting them during verification and verifying them as branches."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from npu_draft.protocol import GREEDY, CancelToken, Draft, SamplingParams
from proxy.acceptance import branch_accept, greedy_accept
from proxy.draft_length import DraftLengthPolicy, RoundCosts
from proxy.drafting import AsyncSessionDrafter, always
from proxy.prompt_json import verify_body_text
from tests.proxy.test_overlap_units import CountingSession, next_token


def best(tokens: Sequence[int]) -> int:
    return next_token(tokens)


def runner_up(tokens: Sequence[int]) -> int:
    return (best(tokens) + 1) % 97


class RunnerUpSession(CountingSession):
    """CountingSession's greedy line, with a runner-up of fixed p at every position."""

    def __init__(self, prob: float = 0.6, alt_prob: float = 0.3) -> None:
        super().__init__(prob)
        self.alt_prob = alt_prob
        self.before: list[list[int]] = []  # the sequence before each drafted token

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        draft = Draft()
        for _ in range(k):
            self.before.append(list(self.tokens))
            draft.alternatives.append((runner_up(self.tokens), self.alt_prob))
            step = super().propose(1)
            draft.tokens += step.tokens
            draft.probs += step.probs
        return draft


def line(start: Sequence[int], n: int) -> list[int]:
    out = list(start)
    for _ in range(n):
        out.append(best(out))
    return out[len(start) :]


async def test_predrafting_follows_the_runner_up_once_it_is_the_likelier_line():
    session = RunnerUpSession(prob=0.6, alt_prob=0.3)
    drafter = AsyncSessionDrafter(session)
    committed = [3, 1, 4]
    try:
        first = await drafter.draft(committed, 2, always)
        assert first.tokens == line(committed, 2)
        assert first.alternatives == [
            (runner_up(committed), 0.3),
            (runner_up(committed + first.tokens[:1]), 0.3),
        ]
        # main line: 0.36 after two tokens, so its third (0.216) loses to the runner-up at
        # position 0 (0.3); that line then holds p 0.3, 0.18, ... against main's 0.216
        assert await drafter.extend(3, CancelToken(), predraft=True) == 3
        side_start = [*committed, runner_up(committed)]
        assert session.before[-2:] == [side_start, side_start + line(side_start, 1)]
        # the server rejected draft 1 and chose the runner-up: its line is ready
        n = len(session.before)
        second = await drafter.draft(side_start, 2, always)
        assert second.tokens == line(side_start, 2) and second.reused == 2
        assert len(session.before) == n  # nothing recomputed
        # drafting goes on from where the side line ended
        third = await drafter.draft(side_start, 3, always)
        assert third.tokens == line(side_start, 3) and third.reused == 2
    finally:
        await drafter.close()


async def test_without_predrafting_only_the_main_line_grows():
    session = RunnerUpSession(prob=0.6, alt_prob=0.3)
    drafter = AsyncSessionDrafter(session)
    committed = [3, 1, 4]
    try:
        first = await drafter.draft(committed, 2, always)
        await drafter.extend(3, CancelToken())
        main = committed + first.tokens
        assert session.before[-1] == main + line(main, 2)
        second = await drafter.draft([*committed, runner_up(committed)], 2, always)
        assert second.reused == 0
    finally:
        await drafter.close()


async def test_branch_leaves_at_the_likeliest_runner_up_and_drafts_on():
    session = RunnerUpSession(prob=0.9, alt_prob=0.08)
    drafter = AsyncSessionDrafter(session)
    committed = [2, 7]
    try:
        first = await drafter.draft(committed, 3, always)
        # reach x runner-up p: 0.08, 0.072, 0.0648: the first position is likeliest
        branch = await drafter.branch(len(first.tokens) + 1, 3)
        assert branch is not None and branch.position == 0 and branch.reach == 1.0
        start = [*committed, runner_up(committed)]
        assert branch.tokens == [start[-1], *line(start, 2)]
        assert branch.probs == [0.08, 0.9, 0.9]
        # the main line is untouched: a round that accepts it reuses its tokens
        accepted = committed + first.tokens
        again = await drafter.draft(accepted[:-1], 1, always)
        assert again.tokens == first.tokens[-1:] and again.reused == 1
    finally:
        await drafter.close()


async def test_branch_is_none_without_runner_ups():
    drafter = AsyncSessionDrafter(CountingSession())  # reports no alternatives
    try:
        first = await drafter.draft([1, 2], 2, always)
        assert first.alternatives == [None, None]
        assert await drafter.branch(3, 2) is None
    finally:
        await drafter.close()


def test_branch_accept_continues_along_the_branch_where_the_target_chose_its_start():
    draft = [10, 11, 12]
    # the target agrees with 10, then says 20 (the branch's first token) at position 1
    target = [10, 20, 99, 98]
    branch = [20, 21, 22]
    branch_target = [21, 22, 23]  # after ..20 -> 21, ..20 21 -> 22, ..20 21 22 -> 23
    got = branch_accept(draft, target, 1, branch, branch_target)
    assert got.tokens == [10, 20, 21, 22, 23] and got.n_accepted == 1
    assert got.via_branch == 3 and got.n_drafted == 3
    # the branch's second token is wrong: the target's own token there ends the round
    got = branch_accept(draft, target, 1, branch, [21, 30, 31])
    assert got.tokens == [10, 20, 21, 30] and got.via_branch == 2


def test_branch_accept_ignores_a_branch_the_target_did_not_take():
    draft, branch = [10, 11, 12], [20, 21]
    plain = greedy_accept(draft, [10, 19, 0, 0])
    assert branch_accept(draft, [10, 19, 0, 0], 1, branch, [21, 5]) == plain  # other token
    early = greedy_accept(draft, [20, 0, 0, 0])
    assert branch_accept(draft, [20, 0, 0, 0], 1, branch, [21, 5]) == early  # stopped before
    assert branch_accept(draft, [10, 11, 12, 7], 1, branch, [21, 5]).tokens == [10, 11, 12, 7]


def test_branch_at_the_bonus_position():
    # every draft accepted and the bonus is the runner-up of the guess at position 2
    got = branch_accept([10, 11], [10, 11, 40], 2, [40], [41])
    assert got.tokens == [10, 11, 40, 41] and got.via_branch == 1 and got.bonus


def test_verify_body_adds_one_prompt_per_branch_token():
    body = json.loads(verify_body_text("1,2", [3, 4, 5], {"n_predict": 1}, (1, [7, 8])))
    assert body["prompt"] == [
        [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 7], [1, 2, 3, 7, 8],
    ]  # fmt: skip
    assert body["n_predict"] == 1


def _policy(verify_per_prompt_ms: float) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(6)
    for n in (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3):
        policy.observe(
            RoundCosts(
                probs=[0.8] * n,
                n_accepted=n,
                n_committed=n + 1,
                draft_ms=2.0 * n,
                verify_ms=20.0 + verify_per_prompt_ms * n,
                round_ms=40.0,
            )
        )
    return policy


def test_branch_length_keeps_what_repays_its_prompts():
    # every draft accepted so far: a = 1 leaves no rejection for a branch to save
    assert _policy(0.0).branch_length(0, 3, 2) == 0
    policy = _policy(0.5)
    policy.acceptance = 0.6
    for _ in range(40):
        policy.observe_runner_up(True)
    # ~13 ms a token; at position 0 the first prompt gains 0.4 x ~0.9 of it (~4.7 ms)
    assert policy.branch_length(0, 3, 2) >= 1
    assert policy.branch_length(6, 3, 2) == 0  # reached with 0.6^6 only
    for _ in range(80):
        policy.observe_runner_up(False)  # the runner-up is rarely the target's token
    assert policy.runner_up_hits < 0.05 and policy.branch_length(0, 3, 2) == 0
    dear = _policy(6.0)
    dear.acceptance, dear.runner_up_hits = 0.6, 0.9
    assert dear.branch_length(0, 3, 2) == 0
    fixed = DraftLengthPolicy(6, adaptive=False)
    assert fixed.branch_length(0, 2, 3) == 2  # fixed k: verify them all


def test_branch_prompts_count_as_verified_length():
    policy = DraftLengthPolicy(6)
    for _ in range(4):
        policy.observe(RoundCosts([0.9], 1, 2, 2.0, 30.0, 40.0, n_branch=2))
    assert policy.snapshot()["rounds"] == 4
    assert policy._by_length[3][1] == 4  # one draft + two branch prompts = 3 beyond ctx


def test_slots_to_copy_follow_the_rounds():
    policy = DraftLengthPolicy(6)
    assert policy.slots_to_copy() == 6  # nothing measured: every slot a round may use
    for _ in range(8):
        policy.observe(RoundCosts([0.9], 1, 2, 2.0, 20.0, 30.0))
    assert policy.slots_to_copy() == 2  # rounds of 2 prompts: their slots, plus one
    assert DraftLengthPolicy(6, adaptive=False).slots_to_copy() == 6
