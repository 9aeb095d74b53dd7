"""The drafter contract: `AsyncDrafter` names every call the proposer makes,
`DrafterBase` answers the ones a propose-only backend leaves out, and every drafter
the proxy builds offers them all."""

from __future__ import annotations

import inspect

import pytest

from npu_draft.protocol import CancelToken
from proxy.drafter_guard import DrafterSupervisor
from proxy.engine import EngineSettings
from proxy.engine.drafting import AsyncDrafter, AsyncSessionDrafter, DrafterBase, always
from proxy.engine.proposer import Proposer

CALLS = ("draft", "extend", "draft_sampled", "close")
FLAGS = ("early_draft", "draft_ahead")


class Counting(DrafterBase):
    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    async def propose(self, committed, k):
        self.asked.append((len(committed), k))
        return list(range(100, 100 + k))

    async def close(self):
        pass


def test_the_protocol_declares_every_call_and_flag() -> None:
    declared = {name for name, _ in inspect.getmembers(AsyncDrafter, inspect.isfunction)}
    assert declared >= set(CALLS)
    assert set(AsyncDrafter.__annotations__) >= set(FLAGS)


@pytest.mark.parametrize("cls", [DrafterBase, AsyncSessionDrafter])
def test_every_drafter_offers_the_whole_contract(cls: type) -> None:
    for name in CALLS:
        assert inspect.iscoroutinefunction(getattr(cls, name)), f"{cls.__name__}.{name}"
    for name in FLAGS:
        assert isinstance(getattr(cls, name), bool), f"{cls.__name__}.{name}"


def test_a_backend_must_propose_and_close() -> None:
    class NoClose(DrafterBase):
        async def propose(self, committed, k):
            return []

    with pytest.raises(TypeError):
        NoClose()  # type: ignore[abstract]


async def test_defaults_of_a_propose_only_backend() -> None:
    drafter = Counting()
    assert not drafter.early_draft and not drafter.draft_ahead
    draft = await drafter.draft([1, 2], 4, always)
    assert draft.tokens == [100, 101, 102, 103] and draft.probs == [] and draft.reused == 0
    draft = await drafter.draft([1, 2, 3], 4, always, 2)  # at most k_fresh fresh tokens
    assert draft.tokens == [100, 101]
    assert drafter.asked == [(2, 4), (3, 2)]
    assert await drafter.extend(3, CancelToken()) == 0
    sampled = await drafter.draft_sampled([1], 3, None, None)  # type: ignore[arg-type]
    assert sampled.tokens == [100, 101, 102] and sampled.dists is None  # no q: point mass


async def test_the_guard_answers_for_a_propose_only_backend() -> None:
    supervisor = DrafterSupervisor(Counting, n_vocab=1000)
    drafter = await supervisor.open()
    # the engine plans on the backend's own flags: no early drafts, nothing ahead
    assert drafter is not None and not drafter.early_draft and not drafter.draft_ahead

    def tokens(draft):
        return draft.tokens

    assert (await supervisor.bounded(drafter.draft([1], 3, always, 1), 3, tokens)).tokens == [100]
    assert await supervisor.bounded(drafter.extend(2, CancelToken()), 2, lambda _n: []) == 0
    sampled = drafter.draft_sampled([1], 2, None, None)  # type: ignore[arg-type]
    assert (await supervisor.bounded(sampled, 2, tokens)).tokens == [100, 101]
    policies = EngineSettings().policies().for_request(None)
    await Proposer(drafter, policies, guard=supervisor).close()
    assert supervisor.failures == 0 and supervisor.sessions_open == 0
