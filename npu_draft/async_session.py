"""AsyncDraftSession: a DraftSession driven from asyncio without blocking the loop.

All calls run, in submission order, on ONE dedicated worker thread per session: the
session's cache is not thread-safe, and ONNX Runtime releases the GIL while it
computes, so the event loop keeps serving other requests (and verification of the
previous round) while the drafter works.

Cancelling: set the CancelToken passed to `propose` (or cancel the awaiting task);
the worker stops after the token it is computing, and `propose` raises
DraftCancelled. Calls queued after a cancelled draft run as soon as it stops.
"""

from __future__ import annotations

import asyncio
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


class AsyncDraftSession:
    def __init__(self, session: DraftSession, name: str = "draft") -> None:
        self._session = session
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"npu-{name}")
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
        await self._call(self._session.close)
        self._closed = True
        self._worker.shutdown(wait=False)
