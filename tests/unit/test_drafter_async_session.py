"""AsyncDraftSession: one worker thread per open session, reused after it closes; the loop
stays free; drafts can be cancelled."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from npu_draft.async_session import WORKERS, AsyncDraftSession, run_on_worker
from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DraftCancelled,
    SyncStats,
    common_prefix_length,
)


class SlowSession:
    """A drafter stand-in: each token takes `delay` seconds and records its thread."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self._tokens: list[int] = []
        self.threads: set[int] = set()
        self.calls: list[str] = []

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        self.threads.add(threading.get_ident())
        self.calls.append(f"sync{len(tokens)}")
        reused = common_prefix_length(self._tokens, tokens)
        self._tokens = list(tokens)
        return SyncStats(reused, len(tokens) - reused)

    def propose(self, k, sampling=GREEDY, rng=None, cancel: CancelToken | None = None) -> Draft:
        self.threads.add(threading.get_ident())
        self.calls.append(f"propose{k}")
        draft = Draft()
        for i in range(k):
            if cancel is not None and cancel.cancelled:
                break
            time.sleep(self.delay)  # blocking, as an ONNX Runtime call would be
            draft.tokens.append(100 + i)
            draft.probs.append(0.9)
            self._tokens.append(100 + i)
        return draft

    def next_logits(self) -> np.ndarray:
        return np.zeros(3, np.float32)

    def close(self) -> None:
        self.calls.append("close")


async def test_calls_run_in_order_on_one_worker_thread() -> None:
    inner = SlowSession(delay=0.001)
    session = AsyncDraftSession(inner)
    await session.sync([1, 2, 3])
    draft = await session.propose(3)
    assert draft.tokens == [100, 101, 102]
    assert session.tokens == (1, 2, 3, 100, 101, 102)
    # submitted back to back without awaiting in between: still in order
    results = await asyncio.gather(session.sync([1, 2, 3, 100]), session.propose(2))
    assert results[0] == SyncStats(4, 0) and results[1].tokens == [100, 101]
    await session.close()
    assert inner.calls == ["sync3", "propose3", "sync4", "propose2", "close"]
    assert len(inner.threads) == 1 and threading.get_ident() not in inner.threads


async def test_event_loop_keeps_running_while_drafting() -> None:
    session = AsyncDraftSession(SlowSession(delay=0.02))
    await session.sync([1])
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await session.propose(10)  # 10 blocking sleeps of 20 ms in the worker
    task.cancel()
    assert ticks >= 5  # a blocked loop would have ticked at most once
    await session.close()


async def test_cancel_token_stops_draft_and_raises() -> None:
    inner = SlowSession(delay=0.02)
    session = AsyncDraftSession(inner)
    await session.sync([1])
    token = CancelToken()
    task = asyncio.create_task(session.propose(200, cancel=token))
    await asyncio.sleep(0.07)
    token.cancel()
    started = time.monotonic()
    with pytest.raises(DraftCancelled):
        await task
    assert time.monotonic() - started < 1.0  # stopped after the token in flight
    assert 1 < len(inner.tokens) < 50
    # the session is usable again and a sync restores the committed sequence
    assert (await session.sync([1, 7])) == SyncStats(1, 1)
    assert session.tokens == (1, 7)
    await session.close()


async def test_cancelling_the_awaiting_task_stops_the_worker() -> None:
    inner = SlowSession(delay=0.02)
    session = AsyncDraftSession(inner)
    await session.sync([1])
    task = asyncio.create_task(session.propose(200))
    await asyncio.sleep(0.07)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await session.sync([1])  # queued behind the draft: runs once it has stopped
    assert inner.calls[-1] == "sync1"
    assert session.tokens == (1,)
    await session.close()
    with pytest.raises(RuntimeError, match="closed"):
        await session.sync([1])


async def test_a_closed_session_hands_its_thread_to_the_next() -> None:
    # ONNX Runtime's CUDA provider builds cuBLAS/cuDNN handles once per thread: a new
    # thread per session paid seconds on every request's first draft
    first, second = SlowSession(delay=0.001), SlowSession(delay=0.001)
    session = AsyncDraftSession(first)
    await session.sync([1])
    await session.close()
    created = WORKERS.created
    session = AsyncDraftSession(second)
    await session.sync([1])
    await session.close()
    assert first.threads == second.threads and WORKERS.created == created
    assert all(thread.is_alive() for thread in threading.enumerate()
               if thread.ident in first.threads)  # fmt: skip


async def test_sessions_open_at_once_draft_on_threads_of_their_own() -> None:
    inners = [SlowSession(delay=0.05), SlowSession(delay=0.05)]
    sessions = [AsyncDraftSession(inner) for inner in inners]
    started = time.monotonic()
    await asyncio.gather(*(s.propose(4) for s in sessions))
    elapsed = time.monotonic() - started
    assert inners[0].threads.isdisjoint(inners[1].threads)
    assert elapsed < 0.35  # side by side (0.2 s), not one after the other (0.4 s)
    await asyncio.gather(*(s.close() for s in sessions))
    assert [inner.calls[-1] for inner in inners] == ["close", "close"]


async def test_the_first_session_drafts_on_the_thread_a_warm_up_ran_on() -> None:
    warmed = run_on_worker(threading.get_ident)
    inner = SlowSession(delay=0.001)
    session = AsyncDraftSession(inner)
    await session.sync([1])
    await session.close()
    assert inner.threads == {warmed} and warmed != threading.get_ident()


async def test_a_thread_still_busy_is_not_lent_until_the_close_has_run() -> None:
    # a drafter call that never returns must not take the next session down with it
    stuck, after = SlowSession(delay=0.3), SlowSession(delay=0.001)
    session = AsyncDraftSession(stuck)
    drafting = asyncio.create_task(session.propose(1))
    await asyncio.sleep(0.05)  # the worker is inside the blocking call now
    closing = asyncio.create_task(session.close())
    await asyncio.sleep(0)
    closing.cancel()  # the request went away while its close waited behind the call
    next_session = AsyncDraftSession(after)
    await next_session.sync([1])
    assert after.threads.isdisjoint(stuck.threads)
    await asyncio.gather(drafting, return_exceptions=True)
    await next_session.close()
    for _ in range(100):  # the close still runs, after the call, on the same thread
        if stuck.calls[-1:] == ["close"]:
            break
        await asyncio.sleep(0.01)
    assert stuck.calls == ["propose1", "close"]
