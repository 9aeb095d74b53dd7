"""Work generations leave running is owned by one object per proxy, which closes it."""

from __future__ import annotations

import asyncio

from proxy.engine.background import BackgroundTasks


async def test_drafter_work_is_seen_until_it_ends() -> None:
    tasks = BackgroundTasks()
    release = asyncio.Event()
    tasks.start(release.wait(), uses_drafter=True)
    tasks.start(asyncio.sleep(0))  # not the drafter's: no answer to drafter_busy
    assert tasks.drafter_busy()
    release.set()
    await asyncio.wait_for(tasks.wait(), 5)
    assert not tasks.drafter_busy()


async def test_close_lets_work_end_then_cancels_what_still_runs() -> None:
    tasks = BackgroundTasks()
    finished = tasks.start(asyncio.sleep(0.01, "done"))
    stuck = tasks.start(asyncio.sleep(3600), uses_drafter=True)
    await asyncio.wait_for(tasks.close(timeout_s=0.2), 5)
    assert finished.result() == "done" and stuck.cancelled()
    assert not tasks.drafter_busy()
