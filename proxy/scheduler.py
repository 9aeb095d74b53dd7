"""Slot groups: each speculative generation needs k+1 idle server slots at once.

The scheduler hands out at most `n_groups` leases; a request that finds none free
either waits in a FIFO queue (bounded in length and in time) or is told to go
through plain pass-through, so the server never holds more verify tasks than slots
(over-subscription splits the batch and re-prefills slots). A full queue refuses
at once (`QueueFull`: the API answers 503 with Retry-After) rather than letting
waiters pile up without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal


class SchedulerBusy(Exception):
    """No slot group free and the policy (or the queue timeout) says don't wait."""


class QueueFull(SchedulerBusy):
    """Every group is busy and `max_queue` requests already wait."""


class SlotScheduler:
    def __init__(
        self,
        total_slots: int,
        group_size: int,
        when_busy: Literal["queue", "passthrough"] = "queue",
        queue_timeout_s: float = 300.0,
        max_queue: int | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError("group size must be at least 1")
        self.group_size = group_size
        self.n_groups = total_slots // group_size
        self.when_busy = when_busy
        self.queue_timeout_s = queue_timeout_s
        self.max_queue = max_queue  # None: unbounded (tests); the CLI always sets one
        self.rejected = 0  # refused because the queue was full
        self._free: list[int] = list(range(self.n_groups))  # group numbers, lowest first
        self._waiters: list[asyncio.Future[int]] = []

    @property
    def active(self) -> int:
        return self.n_groups - len(self._free)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def release(self, group: int) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(group)  # hand the group straight to the next in line
                return
        self._free.append(group)
        self._free.sort()

    async def acquire(self) -> int:
        """Take one slot group (wait, or raise SchedulerBusy) and return its number;
        give it back with release(number)."""
        if self.n_groups == 0:
            raise SchedulerBusy(
                f"llama-server has fewer slots than one group of {self.group_size} needs"
            )
        if self._free and not self._waiters:
            return self._free.pop(0)
        if self.when_busy == "passthrough":
            raise SchedulerBusy("all slot groups busy")
        if self.max_queue is not None and self.queued >= self.max_queue:
            self.rejected += 1
            raise QueueFull(
                f"all {self.n_groups} slot groups busy and {self.queued} requests queued"
            )
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, self.queue_timeout_s)
        except TimeoutError:
            self._abandon(waiter)
            raise SchedulerBusy(f"no slot group free within {self.queue_timeout_s:.0f} s") from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: asyncio.Future[int]) -> None:
        if waiter.done() and not waiter.cancelled():
            self.release(waiter.result())  # a group was handed to us as we left: pass it on
            return
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[int]:
        """Hold one slot group for the body; always given back (cancel included)."""
        group = await self.acquire()
        try:
            yield group
        finally:
            self.release(group)
