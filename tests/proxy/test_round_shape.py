"""`--pad-rounds`: every round of one length is one batch shape (proxy.engine.round_shape).

The fake server here assigns each prompt to a slot as llama-server does (the idle slot
with the longest common prefix, in prompt order; else the least recently used) and
counts the tokens each slot ingests, so the batch sizes the engine's pad prompts aim at
are checked against what a server would really do.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from npu_draft.protocol import common_prefix_length
from proxy.data.verify import VerifyResult
from proxy.engine import EngineSettings, Generation, GenerationParams
from proxy.engine.round_shape import (
    PAD_BASE,
    RoundShape,
    filler_tokens,
    padded_tokens,
    round_tokens,
)
from proxy.engine.server_text import PieceCache
from proxy.policies import PadMode
from tests.proxy.test_units import FakeUpstream, ScriptDrafter


class SlotServer(FakeUpstream):
    """A FakeUpstream whose prompts go to slots by longest common prefix."""

    def __init__(self, script: list[int], n_slots: int) -> None:
        super().__init__(script)
        self.slots: list[list[int]] = [[] for _ in range(n_slots)]
        self.last_used = [0] * n_slots
        self.clock = 0
        self.batches: list[list[tuple[int, int]]] = []  # per batch: (slot, tokens ingested)

    async def verify(self, context, draft, pad=()):
        results = await super().verify(context, draft)
        prompts = [list(context) + list(draft[:i]) for i in range(len(draft) + 1)]
        if pad:
            prompts.append(list(pad))
            results.append(VerifyResult(0, "", False, 0, id_slot=-1))
        idle = set(range(len(self.slots)))
        batch, placed = [], []
        for prompt, result in zip(prompts, results, strict=True):
            self.clock += 1
            best = max(idle, key=lambda s: (common_prefix_length(self.slots[s], prompt),
                                            -self.last_used[s]))  # fmt: skip
            cached = min(common_prefix_length(self.slots[best], prompt), len(prompt) - 1)
            idle.discard(best)
            self.slots[best], self.last_used[best] = list(prompt), self.clock
            placed.append(replace(result, id_slot=best, cached=cached,
                                  prompt_n=len(prompt) - cached))  # fmt: skip
            batch.append((best, len(prompt) - cached))
        self.batches.append(batch)
        return placed


def test_a_round_of_k_after_k_ingests_the_formula_and_the_pad_tops_it_up():
    for k in range(1, 7):
        for accepted in range(k + 1):
            pad = RoundShape(filler_tokens([7, 8])).pad(k, accepted)
            assert round_tokens(k, accepted) + RoundShape.tail(pad) == padded_tokens(k)
            assert len(pad) == PAD_BASE + RoundShape.tail(pad) and RoundShape.tail(pad) >= 1
    shape = RoundShape(filler_tokens([1, 5]))
    assert 1 not in shape.filler and len(set(shape.filler)) == 3
    first, second = shape.pad(3, 1), shape.pad(3, 1)
    assert first[:PAD_BASE] == second[:PAD_BASE] and first[PAD_BASE] != second[PAD_BASE]


async def _generate(pad_rounds: PadMode, wrong_at: set[int], n_slots: int = 6, n: int = 50):
    script = list(range(100, 100 + n + 10))
    server = SlotServer(script, n_slots)
    drafter = ScriptDrafter(script, 2, wrong_at)
    generation = Generation(
        server, [1, 2], GenerationParams(n_predict=n), 1000, drafter, PieceCache(server),
        settings=EngineSettings(k=3, adaptive=False, pad_rounds=pad_rounds),
    )  # fmt: skip
    tokens = [event.token async for event in generation.run()]
    return script, tokens, generation.result, server


@pytest.mark.parametrize("wrong_at", [{3, 9, 10, 17, 30}, {5, 6, 7, 20, 21, 33, 40}])
async def test_padded_rounds_of_one_length_are_batches_of_one_size(wrong_at):
    """With fixed k = 3, every round of three drafts after one of three is a batch of
    padded_tokens(3) tokens and five prompts, whatever was accepted before; the pad
    prompt keeps to one slot, which no round's prompt uses; the output is the
    server's."""
    script, tokens, result, server = await _generate("on", wrong_at)
    assert tokens == script[:50]
    records = result.rounds
    assert len(server.batches) == len(records)
    padded = [(r, b) for r, b in zip(records, server.batches, strict=True) if r.pad_tokens]
    assert len(padded) >= len(records) // 2
    pad_slots = {b[-1][0] for _, b in padded}
    assert len(pad_slots) == 1
    for record, batch in padded:
        assert len(batch) == record.n_drafted + 2 == 5
        real = [n for slot, n in batch[:-1]]
        assert sum(real) == record.server_prompt_tokens
        assert batch[-1][1] == record.pad_tokens
        if record is not padded[0][0]:  # the first pad prompt also fills the base
            assert sum(n for _, n in batch) == padded_tokens(3), batch
        assert not pad_slots & {slot for slot, _ in batch[:-1]}
    # without padding the batch sizes follow what was accepted
    _, tokens, result, server = await _generate("off", wrong_at)
    assert tokens == script[:50]
    assert not any(r.pad_tokens for r in result.rounds)
    sizes = {sum(n for _, n in b) for r, b in zip(result.rounds, server.batches, strict=True)
             if r.n_drafted == 3}  # fmt: skip
    assert len(sizes) > 1


@pytest.mark.parametrize(("total_slots", "padded"), [(4, False), (5, True)])
async def test_a_pad_prompt_only_where_the_server_has_a_slot_to_spare(total_slots, padded):
    """Rounds of three drafts take four slots: on a server of four slots the pad prompt
    would find none idle and wait for the batch to end, so it is left out."""
    from proxy.slot_share import SlotShare, StreamLease

    share = SlotShare(total_slots=total_slots, group_size=4)
    stream = await share.admit(True)
    settings = EngineSettings(k=3, adaptive=False, pad_rounds="on")
    policies = settings.policies().for_request(None, StreamLease(share, stream))
    script = list(range(100, 160))
    server = SlotServer(script, 6)
    generation = Generation(
        server, [1, 2], GenerationParams(n_predict=30), 1000, ScriptDrafter(script, 2, {3}),
        PieceCache(server), settings=settings, policies=policies,
    )  # fmt: skip
    tokens = [event.token async for event in generation.run()]
    assert tokens == script[:30]
    assert any(r.pad_tokens for r in generation.result.rounds) is padded


async def test_auto_pads_in_blocks_and_records_which_rounds_it_could_pad():
    """`auto` explores: the rounds it could pad come in blocks padded and unpadded (the
    record says which), the others say it could not; the output is the server's."""
    from proxy.policies.padding import BLOCK_ROUNDS

    script, tokens, result, _ = await _generate("auto", {7, 40, 90}, n=200)
    assert tokens == script[:200]
    could = [r for r in result.rounds if r.padded is not None]
    # a block unpadded, then padded ones (at least four: the fake server's padded
    # batches, one prompt more, may cost enough more to drop padding then)
    assert [r.padded for r in could[:BLOCK_ROUNDS]] == [False] * BLOCK_ROUNDS
    assert all(r.padded for r in could[BLOCK_ROUNDS : BLOCK_ROUNDS + 4])
    assert all(bool(r.pad_tokens) is r.padded for r in could)
    assert all(not r.pad_tokens for r in result.rounds if r.padded is None)
    assert any(r.padded is None for r in result.rounds)  # the first round, at least
