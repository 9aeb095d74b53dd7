"""The cost model (proxy/bench/costmodel.py) and the acceptance estimate behind it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from proxy.bench.costmodel import (
    acceptance_from_positions,
    ceiling_speedup,
    expected_tokens_per_round,
    predict,
)
from proxy.bench.prom import delta, per_position
from proxy.server.upstream import parse_prometheus


def test_expected_tokens_per_round_limits() -> None:
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(0.8, 0) == 1.0
    # grows with k towards 1/(1-a)
    values = [expected_tokens_per_round(0.8, k) for k in range(1, 40)]
    assert values == sorted(values)
    assert values[-1] == pytest.approx(ceiling_speedup(0.8), rel=1e-3)
    assert math.isinf(ceiling_speedup(1.0))


def test_predict_taking_turns_and_overlapped() -> None:
    p = predict(a=0.8, k=4, draft_ms_per_token=11.0, verify_ms=20.0, overhead_ms=2.0)
    tokens = (1 - 0.8**5) / 0.2
    assert p.tokens_per_round == pytest.approx(tokens)
    assert p.round_ms_turns == pytest.approx(4 * 11 + 20 + 2)
    assert p.round_ms_overlapped == pytest.approx(max(44, 22))
    assert p.tokens_per_s_turns == pytest.approx(1e3 * tokens / 66)
    assert p.tokens_per_s_overlapped == pytest.approx(1e3 * tokens / 44)
    # overlap never loses to taking turns
    q = predict(a=0.6, k=2, draft_ms_per_token=1.0, verify_ms=30.0, overhead_ms=1.0)
    assert q.tokens_per_s_overlapped >= q.tokens_per_s_turns


def _simulated_counters(a: float, k: int, rounds: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    drafted = [0] * k
    accepted = [0] * k
    for _ in range(rounds):
        n = k if rng.random() > 0.02 else int(rng.integers(1, k + 1))  # a few short drafts
        run = 0
        while run < n and rng.random() < a:
            run += 1
        for i in range(n):
            drafted[i] += 1
        for i in range(run):
            accepted[i] += 1
    return drafted, accepted


@pytest.mark.parametrize("a", [0.3, 0.6, 0.9])
def test_acceptance_estimate_recovers_iid_rate(a: float) -> None:
    drafted, accepted = _simulated_counters(a, 6, 20000, seed=1)
    assert acceptance_from_positions(drafted, accepted) == pytest.approx(a, abs=0.01)
    # the plain accepted/drafted ratio is lower: later positions need a run to reach them
    assert sum(accepted) / sum(drafted) < a


def test_acceptance_estimate_without_drafts() -> None:
    assert acceptance_from_positions([], []) is None
    assert acceptance_from_positions([0, 0], [0, 0]) is None


def test_prometheus_parsing_and_deltas() -> None:
    text = (
        "# HELP llamacpp:n_decode_total x\n# TYPE llamacpp:n_decode_total counter\n"
        "llamacpp:n_decode_total 12\n"
        'npu_spec_draft_tokens_per_position_total{position="1"} 3\n'
        'npu_spec_draft_tokens_per_position_total{position="0"} 5\n'
        'npu_spec_draft_ms_bucket{le="+Inf"} 4\n'
    )
    before = parse_prometheus(text)
    after = parse_prometheus(text.replace(" 12\n", " 20\n"))
    assert delta(after, before)["llamacpp:n_decode_total"] == 8
    assert per_position(before, "npu_spec_draft_tokens_per_position_total") == [5, 3]
    assert per_position(before, "missing") == []


# -- ceilings (issue 16) ------------------------------------------------------------


def test_ideal_ceiling_is_the_best_k_of_e_over_round_cost() -> None:
    from proxy.bench.costmodel import ideal_ceiling

    rounds = {1: 10.0, 2: 11.0, 4: 20.0}  # ms
    a = 0.8
    expected = {k: 1e3 * expected_tokens_per_round(a, k) / ms for k, ms in rounds.items()}
    best = ideal_ceiling(a, rounds)
    assert best is not None
    assert best.k == max(expected, key=expected.get) == 2
    assert best.tokens_per_s == pytest.approx(1e3 * (1 + 0.8 + 0.64) / 11.0)
    assert ideal_ceiling(a, {}) is None


def test_overlap_round_and_ceiling() -> None:
    from proxy.bench.costmodel import ideal_ceiling, overlap_ceiling, overlap_round_ms

    # T(k) = t_v + (1 - a^(k+1)) (t_resync + k t_d)
    assert overlap_round_ms(0.5, 2, 10.0, 3.0, 1.0) == pytest.approx(10 + 0.875 * (1 + 6))
    assert overlap_round_ms(1.0, 4, 10.0, 3.0, 1.0) == 10.0  # all accepted: fully hidden
    assert overlap_round_ms(0.0, 4, 10.0, 3.0, 1.0) == pytest.approx(10 + 1 + 12)
    rounds = {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 6: 13.0, 8: 15.0}
    for a in (0.3, 0.6, 0.8, 0.95):
        ideal = ideal_ceiling(a, rounds)
        free = overlap_ceiling(a, rounds, 0.0, 0.0)
        dear = overlap_ceiling(a, rounds, 5.0, 2.0)
        assert ideal is not None and free is not None and dear is not None
        assert free.tokens_per_s == pytest.approx(ideal.tokens_per_s)  # a free draft
        assert dear.tokens_per_s < ideal.tokens_per_s
        assert dear.k <= ideal.k  # a dear draft prefers shorter rounds
        by_hand = max(
            1e3 * expected_tokens_per_round(a, k) / (ms + (1 - a ** (k + 1)) * (2 + 5 * k))
            for k, ms in rounds.items()
        )
        assert dear.tokens_per_s == pytest.approx(by_hand)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.77, 0.9])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_acceptance_from_ratio_inverts_the_fixed_k_ratio(a: float, k: int) -> None:
    from proxy.bench.costmodel import acceptance_from_ratio, expected_accepted_per_round

    ratio = expected_accepted_per_round(a, k) / k
    assert acceptance_from_ratio(ratio, k) == pytest.approx(a, abs=1e-9)
    with pytest.raises(ValueError):
        acceptance_from_ratio(1.5, k)


def test_multi_outcome_rounds_reduce_to_naive_overlap_and_grow_with_coverage() -> None:
    from proxy.bench.costmodel import (
        expected_tokens_per_round,
        multi_outcome_ceiling,
        multi_outcome_round_ms,
        overlap_round_ms,
    )

    a, k, t_v, t_d, resync = 0.8, 4, 93.0, 11.0, 11.0
    # one line whose k + 1 tokens fit under the verification: naive overlap
    assert multi_outcome_round_ms(a, k, t_v, t_d, resync, 1, 0.5) == pytest.approx(
        overlap_round_ms(a, k, t_v, t_d, resync)
    )
    # every rejection point covered and every correction the runner-up: only a wrong
    # guess of the bonus token after an all-accepted round (a^k (1 - a)) drafts afresh
    assert multi_outcome_round_ms(a, k, t_v, t_d, resync, k + 1, 1.0) == pytest.approx(
        t_v + a**k * (1 - a) * (resync + k * t_d)
    )
    rounds = {n: t_v for n in range(1, 8)}
    speeds = [
        multi_outcome_ceiling(a, rounds, t_d, resync, lines, 0.5).tokens_per_s
        for lines in (1, 2, 3, 5)
    ]
    assert speeds == sorted(speeds) and speeds[-1] > speeds[0]
    # a batch that costs far more than one sequence is paid where it does not fit
    dear = multi_outcome_round_ms(a, k, t_v, t_d, resync, 3, 0.5, batch_cost=4.0)
    assert dear > multi_outcome_round_ms(a, k, t_v, t_d, resync, 3, 0.5)
    free = 1e3 * expected_tokens_per_round(a, 7) / t_v
    assert speeds[-1] < free


def test_the_ceiling_round_pays_the_catch_up_at_the_rows_acceptance():
    """A k-draft round after j accepted catches up on j tokens in the slots that held
    fewer: on Strix Halo's Vulkan the k = 2 round after 2 accepted ingests 9 tokens
    and costs 3.4 steps. The ceiling weights each j by its chance at the row's a."""
    from proxy.bench.costmodel import expected_round_ms

    after = {0: 115.0, 1: 120.0, 2: 316.0}
    a = 0.8
    assert expected_round_ms(a, after) == pytest.approx(0.2 * 115 + 0.16 * 120 + 0.64 * 316)
    assert expected_round_ms(a, {0: 1.0, 2: 3.0}) is None  # j = 1 missing
    assert expected_round_ms(a, {}) is None
