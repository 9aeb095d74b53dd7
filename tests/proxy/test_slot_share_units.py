"""Unit tests (no server) for the shared slots (`proxy.slot_share`) and the load gate's
cost model (`proxy.policies.load`): admission, FIFO queue, bound, fair grants, yield
and resume, and the model's decisions on GPU-, CPU- and Strix-Halo-like costs."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.policies import DraftLengthPolicy, OverlapPolicy, PlainRunGate, Policies
from proxy.policies.load import (
    LoadGate,
    LoadMeasures,
    aggregate_plain,
    aggregate_speculating,
    k_under_load,
)
from proxy.scheduler import QueueFull, SchedulerBusy
from proxy.slot_share import SlotShare

# -- the cost model ----------------------------------------------------------------------


def _measures(speedup: float, r: float, plain_ms: float = 10.0) -> LoadMeasures:
    return LoadMeasures(plain_ms, plain_ms / speedup, r * plain_ms)


def test_batching_for_free_lets_everyone_speculate_at_full_k():
    # Strix Halo's shape: a batch of a few more tokens costs about nothing
    free = _measures(speedup=2.0, r=0.0)
    assert k_under_load(n=2, m=1, k_max=4, measures=free) == 4
    assert k_under_load(n=4, m=4, k_max=4, measures=free) == 4


def test_costly_batch_tokens_make_speculation_yield():
    # the 2-core CPU's shape: each more token in a batch costs most of a step
    cpu = _measures(speedup=1.8, r=0.8)
    assert k_under_load(n=2, m=1, k_max=4, measures=cpu) == 0
    assert k_under_load(n=8, m=1, k_max=4, measures=cpu) == 0


def test_cheap_batch_tokens_allow_a_smaller_k():
    # a GPU's shape: more tokens cost a little; plain streams may slow by 10% at most
    gpu = _measures(speedup=2.0, r=0.02)
    k = k_under_load(n=2, m=1, k_max=8, measures=gpu)
    assert 0 < k < 8
    assert (1 + (2 + k - 1) * 0.02) / (1 + 0.02) <= 1.10


def test_unmeasured_or_losing_speculation_never_speculates_under_load():
    assert k_under_load(2, 1, 4, LoadMeasures(None, None, None)) == 0
    assert k_under_load(2, 1, 4, LoadMeasures(10.0, None, 0.0)) == 0
    assert k_under_load(2, 1, 4, _measures(speedup=0.9, r=0.0)) == 0  # plain is faster


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 16),
    m=st.integers(1, 16),
    k_max=st.integers(1, 8),
    speedup=st.floats(0.5, 4.0),
    r=st.floats(0.0, 1.5),
)
def test_a_granted_k_never_loses_aggregate_throughput(n, m, k_max, speedup, r):
    m = min(m, n)
    k = k_under_load(n, m, k_max, _measures(speedup, r))
    if k:
        assert aggregate_speculating(n, m, k, speedup, r) >= aggregate_plain(n, r)


def test_gate_alone_always_allows_full_k_and_plain_mode_never_under_load():
    assert LoadGate("plain").k_for(1, 1, 4) == 4
    assert LoadGate("plain", lambda: _measures(3.0, 0.0)).k_for(2, 1, 4) == 0
    assert LoadGate("auto", lambda: _measures(3.0, 0.0)).k_for(2, 1, 4) == 4


# -- admission -----------------------------------------------------------------------------


async def test_every_slot_serves_a_stream_before_anyone_queues():
    share = SlotShare(total_slots=4, group_size=3, gate=LoadGate("plain"))
    streams = [await share.admit(True) for _ in range(4)]
    assert [s.speculative for s in streams] == [True, False, False, False]
    assert share.streams == 4 and share.queued == 0
    waiter = asyncio.create_task(share.admit(True))
    await asyncio.sleep(0)
    assert share.queued == 1
    share.release(streams[0])
    admitted = await asyncio.wait_for(waiter, 1)
    assert share.streams == 4 and share.queued == 0
    assert not admitted.speculative  # three others are served: no speculation
    for stream in [*streams[1:], admitted]:
        share.release(stream)
    assert share.idle()


async def test_queue_is_fifo_bounded_and_frees_on_cancel():
    share = SlotShare(total_slots=1, group_size=3, max_queue=2)
    held = await share.admit(False)
    first = asyncio.create_task(share.admit(False))
    cancelled = asyncio.create_task(share.admit(False))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await share.admit(False)
    assert share.rejected == 1
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert share.queued == 1
    late = asyncio.create_task(share.admit(False))
    await asyncio.sleep(0)
    share.release(held)
    got_first = await asyncio.wait_for(first, 1)  # the earliest waiter goes first
    assert not late.done()
    share.release(got_first)
    share.release(await asyncio.wait_for(late, 1))
    assert share.idle()


async def test_queue_timeout_and_passthrough_when_busy():
    timed = SlotShare(total_slots=1, group_size=2, queue_timeout_s=0.05)
    held = await timed.admit(False)
    with pytest.raises(SchedulerBusy):
        await timed.admit(False)
    assert timed.queued == 0
    timed.release(held)
    over = SlotShare(total_slots=1, group_size=2, when_busy="passthrough")
    a, b = await over.admit(True), await over.admit(True)
    assert over.streams == 2 and not b.speculative  # llama-server queues it, as alone
    over.release(a)
    over.release(b)


async def test_too_few_slots_for_speculation_pass_through():
    share = SlotShare(total_slots=1, group_size=3)
    stream = await share.admit(True)
    assert not stream.speculative


# -- grants: yield and resume --------------------------------------------------------------


async def test_speculation_yields_to_a_newcomer_and_resumes():
    share = SlotShare(total_slots=6, group_size=5, gate=LoadGate("plain"))
    spec = await share.admit(True)
    assert spec.speculative and share.grant(spec) == 4
    other = await share.admit(True)
    assert not other.speculative
    assert share.grant(spec) == 0 and spec.yielded
    assert share.speculating == 0
    share.release(other)
    assert share.grant(spec) == 4 and not spec.yielded
    events = [e for e, n in share.events if n == spec.number]
    assert events == ["speculative", "yield", "resume"]
    assert (share.metrics.yields, share.metrics.resumes) == (1, 1)


async def test_two_speculating_streams_split_the_free_slots_fairly():
    share = SlotShare(total_slots=8, group_size=5, gate=LoadGate("auto", lambda: _measures(3, 0)))
    a = await share.admit(True)
    assert share.grant(a) == 4
    b = await share.admit(True)
    assert b.speculative and b.group != a.group
    assert share.grant(b) == 2  # 8 slots - 2 streams = 6 to borrow; a holds 4
    assert share.grant(a) == 3  # fair share: (8 - 2) // 2
    assert share.grant(b) == 3
    assert a.extra + b.extra + share.streams <= share.total_slots


class _Lease:
    def __init__(self, k: int, alone: bool) -> None:
        self.k, self._alone = k, alone
        self.held: list[int] = []

    def grant(self) -> int:
        return self.k

    def hold(self, extra: int) -> None:
        self.held.append(extra)

    def alone(self) -> bool:
        return self._alone


def test_policies_yield_by_plain_runs_and_cap_k():
    gate = PlainRunGate("off")
    yielding = Policies(DraftLengthPolicy(4), OverlapPolicy("off"), gate, _Lease(0, False))
    assert yielding.plain_run_tokens() == gate.run_tokens
    assert yielding.k_cap(4) == 0
    sharing = Policies(DraftLengthPolicy(4), OverlapPolicy("off"), gate, _Lease(2, False))
    assert sharing.plain_run_tokens() == 0 and sharing.k_cap(4) == 2
    alone = Policies(DraftLengthPolicy(4), OverlapPolicy("off"), gate)
    assert alone.plain_run_tokens() == 0 and alone.k_cap(4) == 4
