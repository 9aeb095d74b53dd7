"""Work a generation leaves running after its response is done, owned by the proxy.

Two kinds: a draft session that closes only after its timing draft (its worker cannot
be cut short, and the response must not wait for it), and emptying the slots of a
generation that ended with plain decoding chosen. The proxy holds one `BackgroundTasks`
for all its generations: a later generation asks it whether the drafter is still busy
(a plain run beside it is no measure of plain speed), and the proxy closes it on exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundTasks:
    """Tasks started for generations that outlive them; one per proxy."""

    def __init__(self) -> None:
        self._drafter_tasks: set[asyncio.Task[Any]] = set()
        self._other_tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, T], uses_drafter: bool = False) -> asyncio.Task[T]:
        """Run `work` in the background, kept until it ends; `uses_drafter`: it keeps a
        draft session working (`drafter_busy` answers for it)."""
        tasks = self._drafter_tasks if uses_drafter else self._other_tasks
        task = asyncio.create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def drafter_busy(self) -> bool:
        """Whether a draft session of an earlier generation is still working."""
        return any(not task.done() for task in self._drafter_tasks)

    async def wait(self) -> None:
        """Until every task started so far has ended."""
        await asyncio.gather(*self._drafter_tasks, *self._other_tasks, return_exceptions=True)

    async def close(self, timeout_s: float = 5.0) -> None:
        """The proxy is shutting down: let the tasks end (a session closing after its
        timing draft then closes cleanly), cancel what still runs after `timeout_s`."""
        tasks = [*self._drafter_tasks, *self._other_tasks]
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
