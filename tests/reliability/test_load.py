"""Load suite: concurrent streaming conversations through the proxy (bounded for
CI), greedy output equal to each request's solo run, no slot over-subscription,
and a bounded queue that answers 503 + Retry-After when full."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.policies.load import LoadGate
from proxy.scheduler import QueueFull, SchedulerBusy, SlotScheduler
from proxy.slot_share import SlotShare
from tests.reliability.tools import REPO, is_openai_error, proxy_for, record

_spec = importlib.util.spec_from_file_location("npu_spec_load", REPO / "scripts" / "load.py")
assert _spec is not None and _spec.loader is not None
load_script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load_script  # dataclasses look their module up there
_spec.loader.exec_module(load_script)

CONVERSATIONS = int(os.environ.get("NPU_SPEC_LOAD_CONVERSATIONS", "8"))
DURATION_S = float(os.environ.get("NPU_SPEC_LOAD_SECONDS", "10"))


@pytest.mark.server
async def test_concurrent_conversations_under_load(
    request, ref_server, spec_server, reference_drafter
):
    async with proxy_for(spec_server, reference_drafter, k=2, max_queue=64) as proxy:
        report = await load_script.run_load(
            proxy.url,
            conversations=CONVERSATIONS,
            duration_s=DURATION_S,
            max_tokens=48,
            request_timeout_s=60,
            verify_limit=40,
            reference=ref_server,
        )
        capacity = proxy.state.scheduler.capacity
        n_slots = proxy.state.scheduler.total_slots
        assert await proxy.metric("npu_spec_drafter_sessions_open") == 0
        assert proxy.idle()
    assert report["errors"] == {}, report["error_examples"]
    assert report["requests"] >= CONVERSATIONS
    # never more streams than server slots (each needs one; speculation borrows the rest)
    assert report["max_streams_active"] <= capacity <= n_slots
    assert report["greedy_verified"] > 0
    # a greedy turn may differ from its solo run only by a flip at a proven near-tie
    assert report["unexplained_mismatches"] == 0, report["mismatches"]
    flips = report["near_tie_flips"]
    record(
        request.node.nodeid, "load",
        f"{CONVERSATIONS} concurrent streaming conversations for {DURATION_S:g} s",
        report["requests"],
        f"0 errors; latency p50 {report['latency_s']['p50'] * 1e3:.0f} ms, p99 "
        f"{report['latency_s']['p99'] * 1e3:.0f} ms; {report['greedy_tokens_per_s']} greedy "
        f"tokens/s (a 1-thread test llama-server and the numpy reference drafter on 2 CPU "
        f"cores: a correctness load, not a benchmark); at most "
        f"{report['max_streams_active']:g} streams on {n_slots} server slots; "
        f"{report['greedy_equal_to_solo']}/{report['greedy_verified']} greedy turns equal "
        f"to their solo run ({flips} proven near-tie flips)",
        command="pytest tests/reliability/test_load.py -q  (by hand: python scripts/load.py "
        "--url http://127.0.0.1:8080 --reference http://127.0.0.1:8081)",
    )  # fmt: skip


@pytest.mark.server
async def test_full_queue_answers_503_with_retry_after(request, spec_server, reference_drafter):
    # k=2, three server slots: three streams at once (one speculates, two pass
    # through), then two wait in the queue, and the sixth is refused
    three_slots = SlotShare(3, 3, max_queue=2)
    body = {"prompt": "Queue", "n_predict": 120, "temperature": 0}
    async with proxy_for(
        spec_server, reference_drafter, k=2, scheduler=three_slots, retry_after_s=4
    ) as proxy:
        results = await asyncio.gather(*(proxy.post("/completion", body) for _ in range(6)))
        statuses = sorted(status for status, _, _ in results)
        assert statuses == [200, 200, 200, 200, 200, 503], statuses
        for status, payload, headers in results:
            if status == 503:
                assert is_openai_error(payload, 503) and headers["Retry-After"] == "4"
        assert three_slots.rejected == 1
        assert three_slots.max_seen_streams == 3  # never more streams than slots
        assert await proxy.metric("npu_spec_queue_rejections_total") == 1
        assert proxy.idle()
    record(
        request.node.nodeid, "load", "burst beyond server slots + queue bound", 6,
        "3 streams on 3 slots at once + 2 queued are served; the sixth gets 503 in "
        "OpenAI format with Retry-After at once",
    )  # fmt: skip


@settings(settings.get_profile("reliability"), max_examples=60)
@given(
    slots=st.integers(1, 8),
    max_queue=st.integers(0, 3),
    ops=st.lists(st.sampled_from(["admit", "release", "cancel", "grant"]), max_size=30),
)
def test_shared_slots_never_oversubscribe(slots, max_queue, ops):
    """Property: any interleaving of arrivals, completions, cancellations and round
    grants keeps streams <= slots and queued <= max_queue, grants no more slots than
    the streams leave, and loses no stream."""

    async def scenario() -> None:
        share = SlotShare(slots, 3, max_queue=max_queue, gate=LoadGate("plain"))
        held: list = []
        waiting: list[asyncio.Task] = []
        for op in ops:
            if op == "admit":
                waiting.append(asyncio.create_task(share.admit(True)))
            elif op == "release" and held:
                share.release(held.pop(0))
            elif op == "grant" and held:
                stream = held[-1]
                if stream.speculative:
                    others = sum(s.extra for s in held if s is not stream)
                    k = share.grant(stream)
                    assert 0 <= k <= 2 and share.streams + others + k <= slots
            elif op == "cancel":
                pending = [t for t in waiting if not t.cancelling()]
                if pending:
                    pending[0].cancel()
            await asyncio.sleep(0)
            still: list[asyncio.Task] = []
            for task in waiting:
                if not task.done():
                    still.append(task)
                elif not task.cancelled():
                    try:
                        held.append(task.result())
                    except SchedulerBusy as exc:
                        assert isinstance(exc, QueueFull)
            waiting = still
            # a stream handed over from the queue counts before its task resumes
            assert len(held) <= share.streams <= slots
            assert share.queued <= max_queue
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for task in waiting:  # admitted before the cancel arrived: still held
            if task.done() and not task.cancelled() and task.exception() is None:
                held.append(task.result())
        for stream in held:
            share.release(stream)
        assert share.idle()

    asyncio.run(scenario())
    _scheduler_cases.append(1)


@settings(settings.get_profile("reliability"), max_examples=60)
@given(
    groups=st.integers(1, 3),
    max_queue=st.integers(0, 3),
    ops=st.lists(st.sampled_from(["acquire", "release", "cancel"]), max_size=30),
)
def test_scheduler_never_oversubscribes(groups, max_queue, ops):
    """Property: any interleaving of arrivals, completions and cancellations keeps
    active <= groups and queued <= max_queue, and loses no group."""

    async def scenario() -> None:
        scheduler = SlotScheduler(groups * 3, 3, max_queue=max_queue)
        held: list[int] = []
        waiting: list[asyncio.Task[int]] = []
        for op in ops:
            if op == "acquire":
                waiting.append(asyncio.create_task(scheduler.acquire()))
            elif op == "release" and held:
                scheduler.release(held.pop(0))
            elif op == "cancel":
                # tracked until done: a group handed over as it was cancelled is still
                # returned by acquire (wait_for keeps a result that arrived first)
                pending = [t for t in waiting if not t.cancelling()]
                if pending:
                    pending[0].cancel()
            await asyncio.sleep(0)
            still: list[asyncio.Task[int]] = []
            for task in waiting:
                if not task.done():
                    still.append(task)
                elif not task.cancelled():
                    try:
                        held.append(task.result())
                    except SchedulerBusy as exc:
                        assert isinstance(exc, QueueFull)
            waiting = still
            assert scheduler.active <= groups and len(set(held)) == len(held)
            assert scheduler.queued <= max_queue
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for task in waiting:  # a group handed over as we cancelled counts as held
            if task.done() and not task.cancelled() and task.exception() is None:
                held.append(task.result())
        for group in held:
            scheduler.release(group)
        assert scheduler.active == 0 and scheduler.queued == 0

    loop = asyncio.new_event_loop()  # its own loop: the suite's session loop is not touched
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    _scheduler_cases.append(1)


_scheduler_cases: list[int] = []


def test_scheduler_property_recorded(request):
    # runs after the property above (file order): records how many cases it tried
    assert _scheduler_cases, "the scheduler property did not run"
    record(
        request.node.nodeid, "load", "scheduler interleavings (hypothesis)",
        len(_scheduler_cases),
        "arrivals, completions and cancellations in any order: active <= groups, "
        "queue <= bound, no group lost or handed out twice",
        command="pytest tests/reliability/test_load.py -q -k scheduler",
    )  # fmt: skip
