"""The oracle drafter as the engine drives it: one token at a time, in parallel."""

from __future__ import annotations

import asyncio
import time

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
