"""Drafter fault handling: the proxy's supervisor of its draft sessions.

A drafter is an optional accelerator: whatever it does (raise, hang, fail to open),
the request goes on by plain decoding, which is lossless by construction. The
supervisor hands out sessions, is the guard each generation's proposer
(`proxy.engine.proposer`) asks once per drafter call (`bounded`: a time bound, an id
check, a failure counted), re-creates the drafter after a failure, and keeps count of
open sessions so tests can prove that every session a request opened was closed again.

Re-creating starts with the cheapest remedy: the next request opens a fresh session on
the same model. Only a failure to open a session, or a second failure with no good
proposal between the two, reloads the model (where a `reload` is given): a reload costs
seconds and, while in-flight sessions keep the old model alive, a second model's memory
(the 30-minute soak reloaded on every fault and its RSS wandered in a 340-395 MiB band;
docs/RELIABILITY.md, "Soak under faults").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from proxy import native_memory
from proxy.engine.drafting import AsyncDrafter

log = logging.getLogger(__name__)

Opener = Callable[[], AsyncDrafter]
T = TypeVar("T")
RELOAD_AFTER = 2  # failures with no good proposal between them before the model reloads


class DrafterTimeout(Exception):
    """A proposal took longer than the configured bound."""


class DrafterGarbage(Exception):
    """A proposal held ids the target does not have (llama-server would refuse the
    whole verify batch with 400)."""


class DrafterSupervisor:
    """Opens draft sessions, bounds their calls (`proxy.engine.proposer.DraftGuard`),
    and re-creates the drafter after a failure."""

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
        self.recreations = 0  # fresh starts after failures, with or without a reload
        self.reloads = 0  # ... of them, those that loaded the model again
        self._stale = False  # a failure happened: re-create before the next session
        self._strikes = 0  # failures since the last good proposal or reload
        self._lock = asyncio.Lock()

    async def open(self) -> AsyncDrafter | None:
        """A fresh session, or None (plain decoding) when none can be made. The caller
        reports its end with `session_closed`."""
        try:
            if self._stale:
                await self._recreate()
            inner = self._opener()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.report_failure(f"open: {exc!r}", model_suspect=True)
            return None
        if inner is None:
            return None
        self.sessions_open += 1
        return inner

    def session_closed(self) -> None:
        self.sessions_open -= 1

    async def bounded(self, call: Awaitable[T], k: int, tokens_of: Callable[[T], list[int]]) -> T:
        """Await one drafter call within the time bound and check its token ids; report
        and re-raise any failure (the proposer then drops the drafter: plain decoding
        for the rest of the request)."""
        try:
            # inline in the awaiting task (`wait_for` on Python 3.11 wraps the call in a
            # task of its own, one more turn of the event loop before the drafter starts)
            async with asyncio.timeout(self.propose_timeout_s):
                answer = await call
            tokens = tokens_of(answer)
            n_vocab = self.n_vocab
            if n_vocab is not None and any(
                not isinstance(t, int) or not 0 <= t < n_vocab for t in tokens
            ):
                raise DrafterGarbage(f"draft {tokens[:8]} has ids outside 0..{n_vocab - 1}")
            self._strikes = 0
            return answer
        except TimeoutError:
            self.report_failure("timeout")
            raise DrafterTimeout(
                f"drafter took over {self.propose_timeout_s:g} s for {k} tokens"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.report_failure(type(exc).__name__)
            raise

    def report_failure(self, reason: str, model_suspect: bool = False) -> None:
        """A drafter call failed; `model_suspect`: the model itself (it could not open
        a session), so it is reloaded at once."""
        self.failures += 1
        self._strikes += RELOAD_AFTER if model_suspect else 1
        self._stale = True
        log.warning("drafter failed (%s); it will be re-created", reason)

    async def _recreate(self) -> None:
        async with self._lock:
            if not self._stale:
                return  # another request re-created it meanwhile
            reload = self._reload is not None and self._strikes >= RELOAD_AFTER
            if reload:
                self._opener = await asyncio.to_thread(self._reload)
                self._strikes = 0
                self.reloads += 1
            self._stale = False
            self.recreations += 1
            # the failed session's buffers (and, with a reload, the load's) were just
            # freed: hand glibc's free arena space back (a thread; the request goes on)
            native_memory.trim_soon("drafter re-created")
            log.info(
                "drafter re-created (%d so far, %d with the model reloaded)%s",
                self.recreations, self.reloads, "" if reload else ": a fresh session",
            )  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        return {
            "sessions_open": self.sessions_open,
            "failures": self.failures,
            "recreations": self.recreations,
            "reloads": self.reloads,
        }
