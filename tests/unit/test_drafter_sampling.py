"""Draft-side sampling chain against a plain, sort-everything reimplementation."""

from __future__ import annotations

import numpy as np
import pytest

from npu_draft.protocol import SamplingParams
from npu_draft.sampling import (
    choose_token,
    greedy_choice,
    sampling_distribution,
    softmax,
)


def reference_chain(logits: np.ndarray, p: SamplingParams) -> dict[int, float]:
    """llama.cpp's top_k -> top_p -> min_p -> temperature, written the slow obvious way."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1.0:
        probs = softmax(logits[order])
        total, kept = 0.0, []
        for token, prob in zip(order, probs, strict=True):
            kept.append(token)
            total += prob
            if total >= p.top_p:
                break
        order = kept
    if p.min_p > 0.0:
        best = max(logits[i] for i in order)
        order = [i for i in order if logits[i] >= best + np.log(p.min_p)]
    probs = softmax(np.array([logits[i] for i in order]) / p.temperature)
    return dict(zip(order, probs, strict=True))


CHAINS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=1),
]


@pytest.mark.parametrize("params", CHAINS, ids=str)
def test_chain_matches_reference(params: SamplingParams) -> None:
    logits = np.random.default_rng(3).normal(0, 3, 2000).astype(np.float32)
    dist = sampling_distribution(logits, params)
    expected = reference_chain(logits.astype(np.float64), params)
    assert sorted(dist.ids.tolist()) == sorted(expected)
    for token, prob in zip(dist.ids.tolist(), dist.probs, strict=True):
        assert prob == pytest.approx(expected[token], rel=1e-9, abs=1e-12)
    assert dist.probs.sum() == pytest.approx(1.0)


def test_wide_nucleus_beyond_first_look() -> None:
    # Nearly flat logits over 10k tokens: the nucleus is wider than the 4,096 looked at first.
    logits = np.random.default_rng(4).normal(0, 0.01, 10_000)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    dist = sampling_distribution(logits, params)
    expected = reference_chain(logits, params)
    assert len(dist.ids) == len(expected) > 4096
    assert set(dist.ids.tolist()) == set(expected)


def test_top_p_keeps_crossing_token() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    dist = sampling_distribution(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert dist.ids.tolist() == [0, 1]
    np.testing.assert_allclose(dist.probs, [0.625, 0.375])


def test_greedy_choice_probability_is_plain_softmax() -> None:
    logits = np.array([1.0, 3.0, 2.0])
    token, prob = greedy_choice(logits)
    assert token == 1
    assert prob == pytest.approx(softmax(logits)[1])


def test_choose_token_samples_from_distribution() -> None:
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    draws = [choose_token(logits, params, rng)[0] for _ in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
    token, prob, dist = choose_token(logits, params, np.random.default_rng(1))
    assert dist is not None and prob == pytest.approx(dist.prob_of(token))


def test_choose_token_greedy_has_no_distribution() -> None:
    token, prob, dist = choose_token(np.array([0.0, 5.0]), SamplingParams(), None)
    assert (token, dist) == (1, None)
    assert 0.99 < prob < 1.0


def test_a_greedy_draft_carries_its_runner_up_and_leaves_the_logits_as_they_were():
    from npu_draft.protocol import GREEDY, Draft
    from npu_draft.sampling import draft_next, runner_up

    logits = np.array([0.1, 3.0, -1.0, 2.5, 2.9], dtype=np.float32)
    before = logits.copy()
    draft = Draft()
    assert draft_next(draft, logits, GREEDY, None) == 1
    assert draft.runner_ups == [4] and np.array_equal(logits, before)
    frozen = before.copy()
    frozen.flags.writeable = False  # an output buffer it may not write
    assert runner_up(frozen, 1) == 4
    assert runner_up(np.array([5.0, 1.0, 4.0], dtype=np.float32), 0) == 2
