"""Side lines: drafts ready for the likeliest rejections, drafted while the server
verifies (proxy.engine.drafting.SidePlan), with the oracle drafter and a counting fake."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

from npu_draft.oracle import OracleConfig, OracleDraftModel, drafted_token, runner_up_token
from npu_draft.protocol import CancelToken, SyncStats
from proxy.engine import RoundRecord
from proxy.engine.drafting import AsyncSessionDrafter, SidePlan, always
from proxy.policies import DraftLengthPolicy
from tests.proxy.test_overlap_units import CountingSession, expected_draft, next_token

VOCAB = 97  # CountingSession's drafts are ids below it
best = next_token  # the fake draft's first choice after a sequence


def second(tokens: Sequence[int]) -> int:
    return (best(tokens) + 1) % VOCAB


line_after = expected_draft


class LogitSession(CountingSession):
    """CountingSession with logits (`best` first, `second` next); a sync counts only
    the tokens it runs through the model (what differs from its sequence)."""

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        old = list(self.tokens)
        keep = 0
        while keep < min(len(tokens), len(old)) and tokens[keep] == old[keep]:
            keep += 1
        stats = super().sync(tokens)
        self.computed += len(tokens) - keep
        return stats

    def next_logits(self) -> np.ndarray:
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[second(self.tokens)] = 1.0
        logits[best(self.tokens)] = 2.0
        return logits


@contextlib.asynccontextmanager
async def round_with_sides(
    committed: list[int], plan: SidePlan
) -> AsyncIterator[tuple[LogitSession, AsyncSessionDrafter, list[int]]]:
    """(session, drafter, line) after a first round of 3 drafts and one more whose
    verification drafted ahead with `plan` (the first drafts of a generation keep no
    runner-ups: one round arms them); the drafter is closed after."""
    session = LogitSession()
    drafter = AsyncSessionDrafter(session)
    try:
        await drafter.draft(committed, 3, always)
        await drafter.extend(4, CancelToken(), plan)  # arms runner-ups from here on
        drafted = line_after(committed, 3)
        bonus_line = [*committed, *drafted, best([*committed, *drafted])]
        ahead = await drafter.draft(bonus_line, 3, always)  # all accepted: the main line
        assert ahead.reused == 3 and not ahead.from_side
        await drafter.extend(4, CancelToken(), plan)
        yield session, drafter, [*bonus_line, *ahead.tokens]
    finally:
        await drafter.close()


async def test_a_rejection_whose_correction_is_the_runner_up_starts_on_its_side_line():
    plan = SidePlan(verified=3, lines=4, length=3)
    async with round_with_sides([1, 2, 3], plan) as (session, drafter, line):
        n_committed = len(line) - 3  # the round verifies line[-3:]
        for j in range(3):  # a rejection at draft j + 1, corrected to the runner-up
            base = line[: n_committed + j]
            committed = [*base, second(base)]
            computed = session.computed
            taken = await drafter.draft(committed, 3, always)
            assert taken.tokens == line_after(committed, 3)
            assert taken.from_side and taken.reused == 3 and not taken.resynced
            assert session.computed == computed  # nothing drafted while the round waited
            # the next verify starts, and the side lines are drafted again from there
            await drafter.extend(4, CancelToken(), plan)
            line = [*committed, *taken.tokens]
            n_committed = len(committed)


async def test_the_bonus_guess_has_a_side_line_and_the_main_line_still_hits():
    plan = SidePlan(verified=3, lines=4, length=3)
    async with round_with_sides([4, 5], plan) as (_session, drafter, line):
        # all 3 accepted, the bonus is not the guess but its runner-up
        committed = [*line, second(line)]
        taken = await drafter.draft(committed, 3, always)
        assert taken.from_side and taken.tokens == line_after(committed, 3)
        await drafter.extend(4, CancelToken(), plan)
        # all accepted and the bonus guessed: the main line, although the session's
        # cache was left on a side line (it syncs back before drafting on)
        main = [*committed, *taken.tokens]
        bonus = [*main, best(main)]
        taken = await drafter.draft(bonus, 3, always)
        assert taken.tokens == line_after(bonus, 3) and taken.reused == 3
        assert not taken.from_side and not taken.resynced
        longer = await drafter.draft(bonus, 6, always)  # past what was drafted ahead
        assert longer.tokens == line_after(bonus, 6)


async def test_a_correction_no_line_guessed_resyncs():
    plan = SidePlan(verified=3, lines=4, length=3)
    async with round_with_sides([9, 9], plan) as (_session, drafter, line):
        base = line[:-2]
        committed = [*base, (second(base) + 5) % VOCAB]
        taken = await drafter.draft(committed, 3, always)
        assert taken.resynced and not taken.from_side and taken.reused == 0
        assert taken.tokens == line_after(committed, 3)


async def test_side_lines_stop_at_the_plan_and_when_cancelled():
    plan = SidePlan(verified=3, lines=1, length=3)
    async with round_with_sides([1, 2], plan) as (session, drafter, line):
        n_committed = len(line) - 3
        # one line only: the rejection at the first draft
        after_second = [*line[: n_committed + 1], second(line[: n_committed + 1])]
        taken = await drafter.draft(after_second, 3, always)
        assert taken.resynced and not taken.from_side
        await drafter.extend(4, CancelToken(), plan)
        line = [*after_second, *taken.tokens]
        after_first = [*line[:-3], second(line[:-3])]
        assert (await drafter.draft(after_first, 3, always)).from_side
        cancel = CancelToken()
        cancel.cancel()
        computed = session.computed
        assert await drafter.extend(4, cancel, SidePlan(3, 4, 3)) == 0
        assert session.computed == computed


async def test_no_side_lines_asks_no_logits():
    """Without a plan the line never reads logits (a drafter without them still works)."""

    class NoLogits(LogitSession):
        def next_logits(self) -> np.ndarray:
            raise AssertionError("logits read without side lines")

    drafter = AsyncSessionDrafter(NoLogits())
    try:
        first = await drafter.draft([1, 2], 3, always)
        await drafter.extend(4, CancelToken())
        line = [1, 2, *first.tokens]
        assert (await drafter.draft([*line, best(line)], 3, always)).reused == 3
    finally:
        await drafter.close()


@pytest.mark.parametrize("hits", [0.0, 0.5, 1.0])
def test_oracle_runner_up_is_the_truth_at_the_chosen_rate(hits: float):
    truth = [int(t) for t in np.random.default_rng(0).integers(0, 1000, 4000)]
    config = OracleConfig(acceptance=0.5, seed=1, vocab_size=1000, runner_up_hits=hits)
    model = OracleDraftModel([([1, 2, 3], truth)], config)
    ref = model.references[0]
    wrong = [p for p in range(len(truth)) if drafted_token(config, ref, p) != truth[p]]
    found = [runner_up_token(config, ref, p) == truth[p] for p in wrong]
    assert np.mean(found) == pytest.approx(hits, abs=0.04)
    for p in range(200):  # second, and never the draft itself
        assert runner_up_token(config, ref, p) != drafted_token(config, ref, p)
    session = model.open_session()
    session.sync([1, 2, 3, *truth[:10]])
    logits = session.next_logits()
    order = np.argsort(logits)[::-1]
    assert order[0] == drafted_token(config, ref, 10)
    assert order[1] == runner_up_token(config, ref, 10) == session.second_choice()


async def test_oracle_side_lines_follow_the_truth_where_the_runner_up_hits():
    truth = list(range(200, 260))
    config = OracleConfig(acceptance=0.0, seed=2, vocab_size=1000, runner_up_hits=1.0)
    model = OracleDraftModel([([1, 2, 3], truth)], config)
    drafter = AsyncSessionDrafter(model.open_session())
    prompt = [1, 2, 3]
    plan = SidePlan(verified=2, lines=3, length=2)
    try:
        await drafter.draft(prompt, 2, always)
        await drafter.extend(3, CancelToken(), plan)
        # every draft is wrong (a = 0): the first is rejected and corrected to the truth
        first = await drafter.draft([*prompt, truth[0]], 2, always)
        assert first.resynced  # the first round kept no runner-ups
        await drafter.extend(3, CancelToken(), plan)
        second_round = await drafter.draft([*prompt, *truth[:2]], 2, always)
        assert second_round.from_side and second_round.reused == 2
    finally:
        await drafter.close()


def _round(*, after: bool, resynced: bool, from_side: bool, accepted: int = 1) -> RoundRecord:
    return RoundRecord(
        n_drafted=3, n_accepted=accepted, n_committed=accepted + 1, draft_ms=1.0,
        verify_ms=20.0, overhead_ms=1.0, round_ms=22.0, draft_probs=[0.9, 0.8, 0.7],
        fresh_tokens=0 if from_side else 3, fresh_ms=0.0 if from_side else 3.0,
        resynced=resynced, from_side=from_side, drafted_ahead=True, after_ahead=after,
    )  # fmt: skip


def test_the_length_policy_measures_how_often_a_side_line_is_ready():
    policy = DraftLengthPolicy(6)
    a = 0.7
    assert policy.ready_chance(a, 3) == pytest.approx(a**4)  # none measured
    for _ in range(3):  # after drafting ahead: a side line, a miss
        policy.observe(_round(after=True, resynced=False, from_side=True))
        policy.observe(_round(after=True, resynced=True, from_side=False))
    assert policy.side_share == pytest.approx(0.5)
    # a main-line hit says nothing about side lines
    policy.observe(_round(after=True, resynced=False, from_side=False, accepted=3))
    assert policy.side_share == pytest.approx(0.5)
    assert policy.ready_chance(a, 3) == pytest.approx(a**4 + (1 - a**4) * 0.5)
    # a round after one (of its own generation) that did not draft ahead had no side
    # lines to find
    policy.observe(_round(after=False, resynced=True, from_side=False))
    assert policy.side_share == pytest.approx(0.5)


async def test_a_drafter_without_logits_drafts_no_side_lines():
    """The n-gram drafter has no logits: side lines are asked for, none are drafted,
    and drafting ahead on the main line goes on as without them."""

    class NoLogits(LogitSession):
        asked = 0

        def next_logits(self) -> np.ndarray:
            NoLogits.asked += 1
            raise NotImplementedError("no logits")

    drafter = AsyncSessionDrafter(NoLogits())
    plan = SidePlan(verified=3, lines=4, length=3)
    try:
        committed = [1, 2]
        drafted = await drafter.draft(committed, 3, always)
        for _ in range(3):
            await drafter.extend(4, CancelToken(), plan)
            line = [*committed, *drafted.tokens]
            committed = [*line, best(line)]
            drafted = await drafter.draft(committed, 3, always)
            assert drafted.reused == 3 and not drafted.from_side
        assert NoLogits.asked == 1  # asked once, then never again
    finally:
        await drafter.close()


def test_second_choice_leaves_the_logits_as_they_were():
    from proxy.engine.drafting import _second_choice

    logits = np.array([0.5, 3.0, 2.0, -1.0], dtype=np.float32)
    assert _second_choice(logits) == 2
    assert logits.tolist() == [0.5, 3.0, 2.0, -1.0]
    logits.flags.writeable = False  # e.g. a runtime's own output buffer
    assert _second_choice(logits) == 2
