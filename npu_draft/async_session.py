"""AsyncDraftSession: a DraftSession driven from asyncio without blocking the loop.

All calls run, in submission order, on ONE worker thread that the session holds while
it is open: the session's cache is not thread-safe, and ONNX Runtime releases the GIL
while it computes, so the event loop keeps serving other requests (and verification of
the previous round) while the drafter works.

The worker threads outlive the sessions: a closed session hands its thread to the next
one. ONNX Runtime's CUDA provider builds a context for each thread that runs a session
(cuBLAS, cuBLASLt and cuDNN handles) and drops it when the thread ends. With a fresh
thread per session every request paid that again: on an H100 each generation's first
draft waited 2.2-3.5 s for a 513-token prompt that a warm thread takes in 7.6 ms
(docs/BENCHMARKS.md, "The real drafter on CUDA").

Cancelling: set the CancelToken passed to `propose` (or cancel the awaiting task);
the worker stops after the token it is computing, and `propose` raises
DraftCancelled. Calls queued after a cancelled draft run as soon as it stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DraftCancelled,
    DraftSession,
    SamplingParams,
    SyncStats,
)

T = TypeVar("T")


class _Workers:
    """Single-thread executors lent to sessions and taken back at close, never shut
    down: there are as many threads as sessions were ever open at once."""

    def __init__(self) -> None:
        self._idle: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()
        self.created = 0

    def lend(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"npu-draft-{self.created}")

    def take_back(self, worker: ThreadPoolExecutor) -> None:
        """After the session's last call has run on it."""
        with self._lock:
            self._idle.append(worker)


WORKERS = _Workers()


def run_on_worker(fn: Callable[[], T]) -> T:
    """`fn()` on a lent worker thread, waited for: a drafter warmed up there leaves that
    thread's runtime state (the CUDA provider's handles) ready for the next session."""
    worker = WORKERS.lend()
    try:
        return worker.submit(fn).result()
    finally:
        WORKERS.take_back(worker)


class AsyncDraftSession:
    def __init__(self, session: DraftSession) -> None:
        self._session = session
        self._worker = WORKERS.lend()
        self._tokens: tuple[int, ...] = tuple(session.tokens)
        self._closed = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """The session's sequence as of the last finished call."""
        return self._tokens

    async def _call(self, fn: Callable[..., T], *args) -> T:
        if self._closed:
            raise RuntimeError("draft session is closed")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._worker, self._tracked, fn, *args)
        return result

    def _tracked(self, fn: Callable[..., T], *args) -> T:
        try:
            return fn(*args)
        finally:  # on the worker thread: the only place the session changes
            self._tokens = tuple(self._session.tokens)

    async def call(self, fn: Callable[[DraftSession], T]) -> T:
        """Run `fn(session)` on the worker thread, in order with the other calls."""
        return await self._call(fn, self._session)

    async def sync(self, tokens: Sequence[int]) -> SyncStats:
        return await self._call(self._session.sync, list(tokens))

    async def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        token = cancel if cancel is not None else CancelToken()
        try:
            draft = await self._call(self._session.propose, k, sampling, rng, token)
        except asyncio.CancelledError:
            token.cancel()  # the awaiting task went away: stop the worker soon
            raise
        if token.cancelled:
            raise DraftCancelled(f"draft cancelled after {len(draft)} of {k} tokens")
        return draft

    async def next_logits(self) -> np.ndarray:
        return await self._call(self._session.next_logits)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # no call is queued after the close
        worker = self._worker
        closed = worker.submit(self._tracked, self._session.close)
        # the thread goes back once the close has run on it, not before: one stuck in a
        # hung call is never lent again (the next session gets a thread of its own)
        closed.add_done_callback(lambda _: WORKERS.take_back(worker))
        await asyncio.shield(asyncio.wrap_future(closed))  # a cancel leaves it queued
