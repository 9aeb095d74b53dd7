"""Drafter fault handling around the engine's `AsyncDrafter`.

A drafter is an optional accelerator: whatever it does (raise, hang, fail to open),
the request goes on by plain decoding, which is lossless by construction. The
supervisor hands out sessions, bounds each proposal in time, counts failures and
re-creates the drafter after one (a fresh session, and a reloaded model when a
`reload` is given), and keeps count of open sessions so tests can prove that every
session a request opened was closed again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from npu_draft.protocol import CancelToken
from proxy.engine.drafting import AsyncDrafter, DrafterBase, GreedyDraft, StopRule

log = logging.getLogger(__name__)

Opener = Callable[[], AsyncDrafter]


class DrafterTimeout(Exception):
    """A proposal took longer than the configured bound."""


class DrafterGarbage(Exception):
    """A proposal held ids the target does not have (llama-server would refuse the
    whole verify batch with 400)."""


class GuardedDrafter(DrafterBase):
    """One session: proposals bounded in time; a failure is reported once.

    It offers every call, so the engine plans early drafts and drafting ahead with
    it; the inner drafter's own methods (or `DrafterBase`'s defaults) answer them."""

    early_draft = True
    draft_ahead = True

    def __init__(self, inner: AsyncDrafter, supervisor: DrafterSupervisor) -> None:
        self._inner = inner
        self._supervisor = supervisor
        self._closed = False

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        return await self._bounded(self._inner.propose(committed, k), k, lambda d: list(d))

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, k_fresh: int | None = None
    ) -> GreedyDraft:
        inner = self._inner
        call = inner.draft(committed, k_max, worth) if k_fresh is None else (
            inner.draft(committed, k_max, worth, k_fresh)
        )  # fmt: skip
        return await self._bounded(call, k_max, lambda d: d.tokens)

    async def extend(self, n_max: int, cancel: CancelToken) -> int:
        """Drafting ahead; its tokens are checked when a later `draft` hands them out.
        An inner drafter that does not draft ahead is not asked (nothing to bound)."""
        if not self._inner.draft_ahead:
            return 0
        call = self._inner.extend(n_max, cancel)
        return await self._bounded(call, n_max, lambda _made: [])

    async def propose_sampled(
        self, committed: Sequence[int], k: int, sampling: Any, rng: Any
    ) -> Any:
        """Sampling mode (npu_draft Draft with q); same bound and failure reporting.
        An inner drafter without q gives plain tokens (the engine's point-mass rule)."""
        call = self._inner.propose_sampled(committed, k, sampling, rng)
        return await self._bounded(call, k, lambda d: d.tokens)

    async def _bounded(
        self, proposal: Awaitable[Any], k: int, tokens_of: Callable[[Any], list[int]]
    ) -> Any:
        """Await one proposal within the time bound; report and re-raise any failure
        (the engine then falls back to plain decoding for this request)."""
        try:
            draft = await asyncio.wait_for(proposal, self._supervisor.propose_timeout_s)
            tokens = tokens_of(draft)
            n_vocab = self._supervisor.n_vocab
            if n_vocab is not None and any(
                not isinstance(t, int) or not 0 <= t < n_vocab for t in tokens
            ):
                raise DrafterGarbage(f"draft {tokens[:8]} has ids outside 0..{n_vocab - 1}")
            return draft
        except TimeoutError:
            self._supervisor.report_failure("timeout")
            raise DrafterTimeout(
                f"drafter took over {self._supervisor.propose_timeout_s:g} s for {k} tokens"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._supervisor.report_failure(type(exc).__name__)
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._inner.close()
        finally:
            self._supervisor.sessions_open -= 1


class DrafterSupervisor:
    """Opens guarded draft sessions; re-creates the drafter after a failure."""

    def __init__(
        self,
        opener: Opener,
        reload: Callable[[], Opener] | None = None,
        propose_timeout_s: float = 30.0,
        n_vocab: int | None = None,
    ) -> None:
        self._opener = opener
        self.n_vocab = n_vocab
        self._reload = reload  # blocking; returns a fresh opener (new model)
        self.propose_timeout_s = propose_timeout_s
        self.sessions_open = 0
        self.failures = 0  # proposals that raised or timed out, and failed opens
        self.recreations = 0
        self._stale = False  # a failure happened: re-create before the next session
        self._lock = asyncio.Lock()

    def report_failure(self, reason: str) -> None:
        self.failures += 1
        self._stale = True
        log.warning("drafter failed (%s); it will be re-created", reason)

    async def _recreate(self) -> None:
        async with self._lock:
            if not self._stale:
                return  # another request re-created it meanwhile
            if self._reload is not None:
                self._opener = await asyncio.to_thread(self._reload)
            self._stale = False
            self.recreations += 1
            log.info("drafter re-created (%d so far)", self.recreations)

    async def open(self) -> AsyncDrafter | None:
        """A fresh guarded session, or None (plain decoding) when none can be made."""
        try:
            if self._stale:
                await self._recreate()
            inner = self._opener()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.report_failure(f"open: {exc!r}")
            return None
        if inner is None:
            return None
        self.sessions_open += 1
        return GuardedDrafter(inner, self)

    def snapshot(self) -> dict[str, Any]:
        return {
            "sessions_open": self.sessions_open,
            "failures": self.failures,
            "recreations": self.recreations,
        }
