"""The padding policy (`--pad-rounds auto`): it measures padded against unpadded rounds
at each draft length and keeps what is faster there (proxy.policies.padding)."""

from __future__ import annotations

import itertools
import logging

import pytest

from proxy.data.records import RoundRecord
from proxy.policies import SharedPolicies
from proxy.policies.padding import BLOCK_ROUNDS, RETRY_EVERY, PaddingPolicy


def _record(padded: bool | None, k: int = 3, verify_ms: float = 20.0, **fields) -> RoundRecord:
    return RoundRecord(
        n_drafted=k, n_accepted=1, n_committed=2, draft_ms=1.0, verify_ms=verify_ms,
        overhead_ms=0.5, padded=padded, **fields,
    )  # fmt: skip


def _serve(policy: PaddingPolicy, rounds: int, padded_ms: float, unpadded_ms: float,
           k: int = 3) -> list[bool]:  # fmt: skip
    """`rounds` eligible rounds of k drafts whose verify time depends on the choice."""
    choices = []
    for _ in range(rounds):
        padded = policy.decide(k)
        choices.append(padded)
        policy.observe(_record(padded, k, padded_ms if padded else unpadded_ms))
    return choices


@pytest.mark.parametrize("mode", ["on", "off"])
def test_on_and_off_never_change(mode):
    policy = PaddingPolicy(mode)
    choices = _serve(policy, 50, padded_ms=30.0, unpadded_ms=10.0)
    assert set(choices) == {mode == "on"}
    assert policy.snapshot()["chosen"] is (mode == "on") and policy.enabled() is (mode == "on")
    assert policy.lengths == {}  # nothing to learn


def test_auto_explores_in_blocks_then_keeps_padding_where_it_is_faster():
    """The H200's CUDA case: padded rounds of three drafts 18.5 ms, unpadded 21.6 ms."""
    policy = PaddingPolicy("auto")
    assert policy.enabled() and not policy.snapshot()["chosen"]
    choices = _serve(policy, 4 * BLOCK_ROUNDS, padded_ms=18.5, unpadded_ms=21.6)
    assert choices[:BLOCK_ROUNDS] == [False] * BLOCK_ROUNDS  # a block, not single rounds
    assert choices[BLOCK_ROUNDS : 2 * BLOCK_ROUNDS] == [True] * BLOCK_ROUNDS
    assert policy.padded_lengths() == [3]
    assert policy.saving_ms() == pytest.approx(3.1)
    later = _serve(policy, RETRY_EVERY - 4 * BLOCK_ROUNDS, padded_ms=18.5, unpadded_ms=21.6)
    assert all(later[-BLOCK_ROUNDS:]) and policy.snapshot()["deciding"] is False


def test_auto_stops_padding_where_the_extra_tokens_only_cost(caplog):
    """Strix Halo's Vulkan case: a padded round of two drafts is 10 tokens, past the
    8-token matrix-vector edge, and costs more than the unpadded one."""
    caplog.set_level(logging.INFO, logger="proxy.policies.padding")
    policy = PaddingPolicy("auto")
    choices = _serve(policy, 4 * BLOCK_ROUNDS, padded_ms=40.0, unpadded_ms=14.0, k=2)
    assert sum(choices) == 4  # dropped after four padded rounds: hopeless
    assert "rounds of 2 drafts now unpadded (verify 40.0 ms padded, 4 rounds" in caplog.text
    assert policy.padded_lengths() == [] and policy.snapshot()["deciding"] is False
    assert not any(_serve(policy, RETRY_EVERY // 2, padded_ms=40.0, unpadded_ms=14.0, k=2))
    # on CUDA the first padded rounds of a block are slow (graphs not yet replayed): a
    # 30% worse start does not drop a length that then wins
    cuda = PaddingPolicy("auto")
    _serve(cuda, BLOCK_ROUNDS, padded_ms=0.0, unpadded_ms=22.5)
    padded_ms = iter((29.0, 29.0) + (18.5,) * 40)
    for _ in range(3 * BLOCK_ROUNDS):
        padded = cuda.decide(3)
        cuda.observe(_record(padded, 3, next(padded_ms) if padded else 22.5))
    assert cuda.padded_lengths() == [3]


def test_each_draft_length_is_measured_and_chosen_apart():
    """The H200 with adaptive k: padding wins at 3 and 4 drafts and loses at 5, where
    the padded batch (37 tokens) outgrows most unpadded ones."""
    policy = PaddingPolicy("auto")
    costs = {3: (18.7, 22.5), 4: (20.8, 25.2), 5: (30.0, 24.4)}
    for _ in range(6):
        for k, (padded_ms, unpadded_ms) in costs.items():
            _serve(policy, BLOCK_ROUNDS, padded_ms, unpadded_ms, k)
    assert policy.padded_lengths() == [3, 4]
    assert policy.snapshot()["deciding"] is False
    assert not any(_serve(policy, 20, *costs[5], k=5)) and all(_serve(policy, 20, *costs[4], k=4))


def test_auto_retries_a_close_call_for_a_block_less_and_less_often():
    """Padding 8% slower (a close call) is tried again; 60% slower never is."""
    policy = PaddingPolicy("auto")
    choices = _serve(policy, 4 * BLOCK_ROUNDS + 7 * RETRY_EVERY, padded_ms=21.6, unpadded_ms=20.0)
    tries = [i for i, padded in enumerate(choices) if padded and i >= 4 * BLOCK_ROUNDS]
    starts = [i for i in tries if i - 1 not in tries]
    whole = [s for s in starts if s + BLOCK_ROUNDS <= len(choices)]
    assert all(choices[s : s + BLOCK_ROUNDS] == [True] * BLOCK_ROUNDS for s in whole)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) == 3 and gaps == [2 * RETRY_EVERY, 4 * RETRY_EVERY]
    far = PaddingPolicy("auto")
    assert sum(_serve(far, 4 * BLOCK_ROUNDS + 7 * RETRY_EVERY, 32.0, 20.0)) == 4


def test_auto_changes_its_choice_when_the_costs_change():
    policy = PaddingPolicy("auto")
    _serve(policy, 4 * BLOCK_ROUNDS, padded_ms=18.0, unpadded_ms=22.0)
    assert policy.padded_lengths() == [3]
    # padded rounds grow slower (another stream's work in the server, say): it stops
    _serve(policy, 3 * RETRY_EVERY, padded_ms=30.0, unpadded_ms=22.0)
    assert policy.padded_lengths() == []


def test_auto_needs_a_share_of_the_round_and_settles_unpadded_without_it():
    """The H100's case: padded rounds of 5 drafts saved ~1 ms of ~25 (4%), less than
    the 5% that pays for the slot padding holds; and a 0.2 ms difference is noise."""
    for padded_ms, unpadded_ms in ((24.3, 25.3), (20.2, 20.4)):
        policy = PaddingPolicy("auto")
        _serve(policy, 6 * BLOCK_ROUNDS, padded_ms, unpadded_ms)
        assert policy.snapshot()["deciding"] is True and policy.padded_lengths() == []
        _serve(policy, 8 * BLOCK_ROUNDS, padded_ms, unpadded_ms)
        assert policy.snapshot()["deciding"] is False and policy.padded_lengths() == []
        assert not any(_serve(policy, RETRY_EVERY // 2, padded_ms, unpadded_ms))


def test_rounds_it_could_not_pad_or_that_caught_up_teach_nothing():
    policy = PaddingPolicy("auto")
    for _ in range(40):
        policy.observe(_record(None, verify_ms=5.0))
        policy.observe(_record(True, verify_ms=5.0, catch_up=True))
    assert policy.lengths == {} and policy.saving_ms() is None


def test_the_shared_policies_hand_each_request_the_one_padding_policy():
    shared = SharedPolicies.build(4, pad_rounds="auto")
    one, two = shared.for_request(None), shared.for_request(None)
    assert one.padding is two.padding is shared.padding
    one.observe(_record(True, k=3, verify_ms=18.0))
    assert shared.padding.lengths[3].verify_n == {True: 1, False: 0}
    with pytest.raises(ValueError, match="pad mode"):
        PaddingPolicy("sometimes")  # type: ignore[arg-type]


def test_a_round_padded_to_compare_teaches_the_draft_length_its_acceptance_not_its_cost():
    """While padding is tried at a length, the padded rounds are trials (the length
    runs unpadded); once padding is chosen, the unpadded retries are. A trial's verify
    time stays out of what the draft-length policy takes the length to cost; its
    acceptance counts."""
    policies = SharedPolicies.build(4, pad_rounds="auto").for_request(None)
    length = policies.draft_length

    def observe(padded: bool, verify_ms: float) -> bool:
        record = _record(padded, verify_ms=verify_ms, draft_probs=(0.8, 0.8, 0.8))
        trial = policies.padding.trial(record)
        policies.observe(record)
        return trial

    assert not observe(False, 20.0)
    assert observe(True, 45.0)  # an H100's padded round of five drafts took 37-50 ms
    assert length._by_length[3] == (20.0, 1) and length.rounds == 2
    policies.padding.lengths[3].chosen = True
    assert observe(False, 30.0) and not observe(True, 18.0)
    assert length._by_length[3] == (19.0, 2) and length.rounds == 4
    assert not PaddingPolicy("on").trial(_record(True)) and not policies.padding.trial(
        _record(None)
    )
