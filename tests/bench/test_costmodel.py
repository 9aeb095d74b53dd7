"""The cost model of DESIGN.md section 4 and the acceptance estimate behind it."""

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
from proxy.upstream import parse_prometheus


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
