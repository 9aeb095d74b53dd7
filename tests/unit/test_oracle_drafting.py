"""The oracle drafter as the engine drives it: one token at a time, in parallel."""

from __future__ import annotations

import asyncio
import time

import pytest

from npu_draft.async_session import AsyncDraftSession
from npu_draft.oracle import OracleConfig, OracleDraftModel, drafted_token

VOCAB = 1000
PROMPT = [7, 8, 9]
TRUTH = list(range(100, 180))


def _model(a: float, delay_ms: float = 0.0) -> OracleDraftModel:
    config = OracleConfig(acceptance=a, delay_ms=delay_ms, seed=3, vocab_size=VOCAB)
    return OracleDraftModel([(PROMPT, TRUTH)], config)


def test_drafts_on_past_its_own_wrong_draft_one_token_at_a_time():
    """The engine drafts token by token: a round must still get all the drafts it asked
    for after a corrupted one (a real drafter does not stop there)."""
    model = _model(0.5)
    ref = model.references[0]
    wrong = next(p for p in range(len(TRUTH)) if drafted_token(model.config, ref, p) != TRUTH[p])
    session = model.open_session()
    session.sync(PROMPT + TRUTH[:wrong])
    drafted = [session.propose(1).tokens[0] for _ in range(6)]
    assert drafted[0] != TRUTH[wrong]  # the wrong one, then five more
    assert drafted == [drafted_token(model.config, ref, wrong + i) for i in range(6)]


def test_a_committed_sequence_off_the_path_gets_no_drafts():
    """A committed sequence that left the recorded output (a near-tie the target broke
    the other way): the oracle knows nothing after it, so it drafts nothing."""
    model = _model(0.9)
    session = model.open_session()
    session.sync([*PROMPT, TRUTH[0] + 1])
    assert session.propose(3).tokens == []
    session.sync([*PROMPT, TRUTH[0] + 1, *TRUTH[1:5]])
    assert session.propose(1).tokens == []
    session.sync([1, 2, 3])  # an unknown prompt
    assert session.propose(3).tokens == []


async def test_the_delay_holds_neither_the_event_loop_nor_other_threads():
    """40 ms of drafting on the drafter thread: the event loop keeps running meanwhile."""
    model = _model(1.0, delay_ms=10.0)
    drafter = AsyncDraftSession(model.open_session())
    await drafter.sync(PROMPT)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    draft = await drafter.propose(4)
    elapsed = time.perf_counter() - started
    ticker.cancel()
    await drafter.close()
    assert draft.tokens == TRUTH[:4]
    assert elapsed >= 0.04
    assert ticks >= 5  # the loop ran while the drafter slept


def _sleeps(monkeypatch) -> list[float]:
    """The oracle's per-token delays, recorded instead of slept."""
    import npu_draft.oracle as oracle

    slept: list[float] = []
    monkeypatch.setattr(oracle.time, "sleep", slept.append)
    return slept


def _hits_model(hits: float) -> OracleDraftModel:
    config = OracleConfig(
        acceptance=0.5, delay_ms=11.0, seed=3, vocab_size=VOCAB, runner_up_hits=hits
    )
    return OracleDraftModel([(PROMPT, TRUTH)], config)


def _missed(model: OracleDraftModel, covered: bool) -> int:
    """A position where the oracle drafts wrong and its runner-up is (or is not) the
    target's token."""
    from npu_draft.oracle import runner_up_hit

    ref = model.references[0]
    return next(
        p for p in range(len(TRUTH) - 8)
        if drafted_token(model.config, ref, p) != TRUTH[p]
        and runner_up_hit(model.config, ref, p) == covered
    )  # fmt: skip


def test_each_draft_offers_a_runner_up_the_target_token_where_it_hits(monkeypatch):
    """runner_up_hits: a wrong draft whose runner-up hits offers the target's token as
    its runner-up; one that misses, and a right draft, offer a token that is neither
    the target's nor the draft's. Every token costs the delay (the engine drafts the
    runner-up lines itself, in its own time)."""
    slept = _sleeps(monkeypatch)
    model = _hits_model(0.5)
    ref = model.references[0]
    session = model.open_session()
    for covered in (True, False):
        miss = _missed(model, covered)
        session.sync(PROMPT + TRUTH[:miss])
        slept.clear()
        draft = session.propose(2)
        assert slept == [0.011, 0.011]
        assert draft.tokens[0] == drafted_token(model.config, ref, miss) != TRUTH[miss]
        if covered:
            assert draft.runner_ups[0] == TRUTH[miss]
        else:
            assert draft.runner_ups[0] not in (TRUTH[miss], draft.tokens[0])
    hit = next(p for p in range(len(TRUTH)) if drafted_token(model.config, ref, p) == TRUTH[p])
    session.sync(PROMPT + TRUTH[:hit])
    draft = session.propose(1)
    assert draft.tokens == [TRUTH[hit]] and draft.runner_ups[0] != TRUTH[hit]
    assert len(draft.runner_ups) == len(draft.tokens)


def test_runner_up_hits_cover_their_share_of_misses_and_none_by_default(monkeypatch):
    from npu_draft.oracle import runner_up_hit

    long_truth = list(range(100, 5100))
    for hits in (0.0, 0.42, 1.0):
        config = OracleConfig(acceptance=0.5, seed=3, vocab_size=10_000, runner_up_hits=hits)
        ref = OracleDraftModel([(PROMPT, long_truth)], config).references[0]
        share = sum(runner_up_hit(config, ref, p) for p in range(len(long_truth))) / 5000
        assert abs(share - hits) < 0.03
    with pytest.raises(ValueError, match="runner-up hits"):
        OracleConfig(runner_up_hits=1.5)


def test_runner_up_hits_travel_in_the_oracle_folder(tmp_path):
    from npu_draft.oracle import write_oracle_folder

    config = OracleConfig(acceptance=0.8, delay_ms=11.0, runner_up_hits=0.42)
    folder = write_oracle_folder(tmp_path / "o", [(PROMPT, TRUTH)], config)
    assert OracleDraftModel.from_folder(folder).config == config
