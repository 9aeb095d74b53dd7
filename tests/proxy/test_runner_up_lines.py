"""Runner-up lines: while the server verifies, the drafter also drafts the lines after its
second choices at the round's likeliest misses (`proxy.engine.drafting.RunnerUpLines`),
with a deterministic fake session."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from npu_draft.protocol import CancelToken, Draft, SyncStats
from proxy.engine import EngineSettings
from proxy.engine.drafting import AsyncSessionDrafter, GreedyDraft, RunnerUpLines, always
from proxy.engine.proposer import Proposer
from tests.proxy.test_overlap_units import CountingSession


def best(tokens: Sequence[int]) -> int:
    return (tokens[-1] * 7 + len(tokens)) % 97


def second(tokens: Sequence[int]) -> int:
    return (best(tokens) + 1) % 97


class RunnerUpSession(CountingSession):
    """Greedy draft and runner-up: fixed functions of the sequence; p by position after
    the prompt (`probs`, else 0.9); counts the tokens it drafts and keeps what it was
    synced to."""

    def __init__(self, probs: dict[int, float] | None = None) -> None:
        super().__init__()
        self.probs = probs or {}
        self.synced: list[list[int]] = []

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        self.synced.append(list(tokens))
        return super().sync(tokens)

    def draft_one(self, draft: Draft) -> None:
        draft.tokens.append(best(self._tokens))
        draft.runner_ups.append(second(self._tokens))
        draft.probs.append(self.probs.get(len(self._tokens), 0.9))


def line_after(committed: Sequence[int], n: int) -> list[int]:
    line = list(committed)
    for _ in range(n):
        line.append(best(line))
    return line[len(committed) :]


def lines(pending: int, most: int = 8, until_s: float = 60.0) -> RunnerUpLines:
    return RunnerUpLines(pending, 1, most, time.perf_counter() + until_s)


async def test_the_round_after_a_runner_up_miss_takes_its_draft_ready():
    """k = 1: the draft d1, then drafting ahead d2 (the bonus guess) and d3, then the
    lines after d1's and d2's runner-ups. A rejection of d1 by its runner-up, and a bonus
    that is d2's runner-up, each find their next draft ready (nothing drafted, no sync);
    the line after them drafts on correctly."""
    committed = [3, 4, 5]
    for miss_at in (0, 1):
        session = RunnerUpSession()
        drafter = AsyncSessionDrafter(session)
        try:
            first = await drafter.draft(committed, 1, always)
            assert first.tokens == line_after(committed, 1)
            assert await drafter.extend(2, CancelToken(), lines(pending=1)) == 2
            accepted = committed + line_after(committed, miss_at)
            after_miss = [*accepted, second(accepted)]
            proposed, synced = session.computed, len(session.synced)
            ready = await drafter.draft(after_miss, 1, always)
            assert ready.tokens == line_after(after_miss, 1)
            assert ready.runner_up_line and ready.reused == 1 and ready.fresh == 0
            assert (session.computed, len(session.synced)) == (proposed, synced)
            # drafting on from the runner-up line: the session goes back to it first
            longer = await drafter.draft(after_miss, 3, always)
            assert longer.tokens == line_after(after_miss, 3) and longer.fresh == 2
        finally:
            await drafter.close()


async def test_the_all_accepted_line_stays_ready_after_runner_up_lines():
    """Drafting the runner-up lines moves the session away from the all-accepted line;
    a hit still takes its drafted tokens, and drafting on re-syncs to that line."""
    committed = [9, 1]
    session = RunnerUpSession()
    drafter = AsyncSessionDrafter(session)
    try:
        first = await drafter.draft(committed, 2, always)
        await drafter.extend(3, CancelToken(), lines(pending=2))
        hit = committed + line_after(committed, 3)  # both accepted, bonus as guessed
        assert first.tokens == line_after(committed, 2)
        proposed = session.computed
        taken = await drafter.draft(hit, 4, always)
        assert taken.tokens == line_after(hit, 4)
        assert taken.reused == 2 and session.computed == proposed + 2
        assert not taken.runner_up_line
    finally:
        await drafter.close()


async def test_runner_up_lines_go_likeliest_miss_first_and_only_while_time_is_left():
    """The draft's own p orders the misses: p 0.95 at d1 and 0.4 at the bonus guess
    put the bonus's runner-up line first; with room for one line, the rejection of d1
    by its runner-up drafts fresh. A deadline already past drafts no line at all."""
    committed = [2, 7]
    n = len(committed)
    d1 = line_after(committed, 1)
    bonus_miss = [*committed, *d1, second(committed + d1)]
    rejection = [*committed, second(committed)]
    for outcome, most, until_s, ready in (
        (bonus_miss, 1, 60.0, True),
        (rejection, 1, 60.0, False),
        (rejection, 2, 60.0, True),
        (bonus_miss, 2, -1.0, False),
    ):
        session = RunnerUpSession(probs={n: 0.95, n + 1: 0.4})
        drafter = AsyncSessionDrafter(session)
        try:
            await drafter.draft(committed, 1, always)
            await drafter.extend(2, CancelToken(), lines(1, most, until_s))
            taken = await drafter.draft(outcome, 1, always)
            assert taken.tokens == line_after(outcome, 1)
            assert taken.runner_up_line is ready and taken.resynced is not ready
        finally:
            await drafter.close()


class RecordingDrafter:
    """What the proposer asks of drafting ahead: the lines it passes."""

    early_draft = False
    draft_ahead = True

    def __init__(self) -> None:
        self.lines: list[RunnerUpLines | None] = []

    async def draft(self, committed, k_max, worth, k_fresh=None) -> GreedyDraft:
        return GreedyDraft(tokens=[1] * k_max, probs=[0.9] * k_max)

    async def extend(self, n_max: int, cancel: CancelToken, *lines: RunnerUpLines) -> int:
        self.lines.append(lines[0] if lines else None)
        return 0

    async def draft_sampled(self, *args):  # pragma: no cover - greedy only here
        raise NotImplementedError

    async def close(self) -> None:
        pass


async def _ahead_twice(runner_up_lines: bool) -> tuple[list[RunnerUpLines | None], float]:
    """The lines of two verifications of 20 ms each, and when the second began."""
    drafter = RecordingDrafter()
    policies = EngineSettings(overlap="on").policies().for_request(None)
    proposer = Proposer(drafter, policies, runner_up_lines=runner_up_lines)  # type: ignore[arg-type]
    began = 0.0
    for _ in range(2):
        await proposer.draft([1, 2], 2)
        began = time.perf_counter()
        proposer.draft_ahead(2)
        await asyncio.sleep(0.02)  # the server verifies
        await proposer.stop_ahead()
    await proposer.close()
    return drafter.lines, began


async def test_the_proposer_asks_for_lines_once_it_has_timed_a_verification():
    """No lines before a verification was timed (nothing bounds them); after one, lines
    for every position of the round, bounded by the verify time measured; none when
    switched off."""
    (first, then), began = await _ahead_twice(True)
    assert first is None and then is not None
    assert then.pending == 2 and then.most == 3 and then.length >= 1
    assert began + 0.85 * 0.02 <= then.until < began + 0.85 * 0.2
    assert (await _ahead_twice(False))[0] == [None, None]
