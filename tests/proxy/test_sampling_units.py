"""Sampling mode with fakes: eligibility, the verify request and its parsing, the
engine's bookkeeping of sampled tokens, metrics."""

from __future__ import annotations

import numpy as np
import pytest

from npu_draft.protocol import Draft, SparseDist
from proxy.api.requests import NotEligible, parse_chat, parse_completion
from proxy.data.sampling import MAX_VERIFY_TOP_K, SamplingSpec
from proxy.data.verify import VerifyResult
from proxy.engine import EngineSettings, Generation, GenerationParams, verdict_of
from proxy.engine.drafting import DrafterBase
from proxy.engine.server_text import PieceCache
from proxy.metrics import ProxyMetrics
from proxy.server.upstream import parse_candidates, sampling_verify_params

# llama-server b11434's own defaults, as /props reports them
DEFAULTS = {
    "seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
    "top_k": 40, "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "mirostat": 0,
    "n_predict": -1, "ignore_eos": False, "n_probs": 0, "min_keep": 0,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature"],
}  # fmt: skip


def spec_of(body: dict, defaults: dict = DEFAULTS) -> SamplingSpec | None:
    return parse_completion({"prompt": "hi", **body}, defaults, oai=False)[1].sampling


# -- eligibility -------------------------------------------------------------------


def test_default_request_samples_speculatively_with_the_servers_chain():
    spec = spec_of({})
    assert spec is not None and spec.seed is None  # 4294967295: a random seed
    chain = spec.chain
    assert (chain.temperature, chain.top_k, chain.top_p, chain.min_p) == pytest.approx(
        (0.8, 40, 0.95, 0.05)
    )


def test_request_values_and_seed():
    spec = spec_of({"temperature": 0.6, "top_k": 20, "top_p": 0.9, "min_p": 0.0, "seed": 42})
    assert spec.seed == 42 and spec.chain.top_k == 20 and spec.chain.temperature == 0.6
    assert spec_of({"seed": -1}).seed is None  # the server's "random"
    assert spec_of({"seed": 2**32 + 5}).seed == 5  # kept as uint32, like the server
    assert spec_of({"min_keep": 3}).min_keep == 3
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "seed": 1}, DEFAULTS)
    assert chat.sampling is not None and chat.sampling.seed == 1


def test_greedy_requests_stay_greedy():
    assert spec_of({"temperature": 0}) is None
    assert spec_of({"temperature": 1.0, "top_k": 1}) is None  # top_k 1 is the argmax


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": 0},  # whole vocabulary: n_probs cannot return it
        {"top_k": MAX_VERIFY_TOP_K + 1},
        {"typical_p": 0.9},
        {"repeat_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"dry_multiplier": 0.8},
        {"xtc_probability": 0.5},
        {"mirostat": 2},
        {"dynatemp_range": 0.5},
        {"top_n_sigma": 1.5},
        {"logit_bias": [[15, -1.0]]},
        {"grammar": "root ::= [a-z]"},
        {"n_probs": 3},
        {"samplers": ["temperature", "top_k"]},
        {"seed": "7"},
        {"top_p": "x"},
        {"min_keep": -1},
    ],
)
def test_sampling_the_engine_does_not_mirror_passes_through(extra):
    with pytest.raises(NotEligible):
        spec_of({"temperature": 0.7, **extra})


def test_the_servers_own_sampler_chain_decides():
    reordered = {**DEFAULTS, "samplers": ["temperature", "top_k", "top_p", "min_p"]}
    with pytest.raises(NotEligible, match="order"):
        spec_of({}, reordered)
    no_top_k = {**DEFAULTS, "samplers": ["top_p", "min_p", "temperature"]}
    with pytest.raises(NotEligible, match="top_k"):
        spec_of({}, no_top_k)
    extra_stage = {**DEFAULTS, "samplers": ["top_k", "adaptive_p", "temperature"]}
    with pytest.raises(NotEligible, match="adaptive_p"):
        spec_of({}, extra_stage)
    # a stage missing from the server's chain is not applied there: neutral here too
    no_top_p = {**DEFAULTS, "samplers": ["top_k", "min_p", "temperature"]}
    assert spec_of({}, no_top_p).chain.top_p == 1.0
    # a non-neutral default the request does not override still counts
    with pytest.raises(NotEligible):
        spec_of({}, {**DEFAULTS, "repeat_penalty": 1.1})


# -- the verify request and its parsing ------------------------------------------------


def test_verify_params_return_the_whole_post_sampling_distribution():
    spec = spec_of({"temperature": 0.7, "top_k": 12, "top_p": 0.9, "min_p": 0.02})
    body = sampling_verify_params(spec, seed=99)
    assert body["n_probs"] == body["top_k"] == 12  # top_k <= n_probs: nothing cut off
    assert body["post_sampling_probs"] is True
    assert body["samplers"] == ["top_k", "top_p", "min_p", "temperature"]  # nothing else
    assert (body["temperature"], body["top_p"], body["min_p"]) == (0.7, 0.9, 0.02)
    assert body["seed"] == 99 and body["n_predict"] == 1
    assert "completion_probabilities" in body["response_fields"]


def test_parse_candidates_and_verdict():
    result = {
        "completion_probabilities": [
            {
                "id": 5,
                "prob": 0.6,
                "top_probs": [
                    {"id": 5, "token": "a", "bytes": [97], "prob": 0.6},
                    {"id": 8, "token": "\ufffd", "bytes": [0xE4, 0xBD], "prob": 0.3},
                    {"id": 9, "token": "é", "bytes": [0xC3, 0xA9], "prob": 0.1000001},
                ],
            }
        ]
    }
    candidates = parse_candidates(result)
    assert candidates == ((5, b"a", 0.6), (8, b"\xe4\xbd", 0.3), (9, b"\xc3\xa9", 0.1000001))
    verdict = verdict_of(VerifyResult(5, "a", False, candidates=candidates))
    assert verdict.sampled == 5 and verdict.partial == frozenset({8})
    assert verdict.dist.probs.sum() == pytest.approx(1.0, abs=1e-15)
    assert parse_candidates({}) is None
    assert parse_candidates({"completion_probabilities": []}) is None
    assert verdict_of(VerifyResult(8, "\ufffd", False, candidates=None)).dist is None


# -- the engine's sampling path with fakes ---------------------------------------------


class FakeSamplingUpstream:
    """p is fixed: token 20 ("x") 0.5, 21 ("é", two bytes) 0.3, 99 (EOG, "") 0.2."""

    P = ((20, b"x", 0.5), (21, b"\xc3\xa9", 0.3), (99, b"", 0.2))

    def __init__(self) -> None:
        self.bodies: list[tuple[int, list[int], int]] = []

    async def verify(self, context, draft, sampling=None, seed=0, pad=()):
        assert sampling is not None and not pad
        self.bodies.append((len(context), list(draft), seed))
        # the server's own draw is always 20 here; the engine draws its own tokens
        return [
            VerifyResult(20, "x", False, 0, 0, candidates=self.P) for _ in range(len(draft) + 1)
        ]

    async def eog_tokens(self):
        return frozenset({99})

    async def token_bytes(self, token):  # every token's bytes came with the candidates
        raise AssertionError(token)


class FixedDrafter(DrafterBase):
    def __init__(self) -> None:
        self.q = SparseDist(np.array([20, 21]), np.array([0.5, 0.5]))

    async def propose(self, committed, k):
        raise AssertionError

    async def draft_sampled(self, committed, k, sampling, rng):
        tokens = [int(rng.choice([20, 21])) for _ in range(k)]
        return Draft(tokens, [0.5] * k, [self.q] * k)

    async def close(self):
        pass


async def _sample(seed: int, n_predict: int = 12):
    upstream = FakeSamplingUpstream()
    spec = spec_of({"temperature": 1.0, "top_k": 3, "seed": seed})
    metrics = ProxyMetrics()
    generation = Generation(
        upstream, [1, 2], GenerationParams(n_predict=n_predict, sampling=spec), 1000,
        FixedDrafter(), PieceCache(upstream), observer=metrics, settings=EngineSettings(k=3),
    )  # fmt: skip
    events = [event async for event in generation.run()]
    return events, generation.result, upstream, metrics


async def test_engine_commits_its_own_draws_with_their_pieces_and_eog():
    ended_by_eog = 0
    for seed in range(20):
        events, result, _, _ = await _sample(seed)
        tokens = [e.token for e in events]
        assert set(tokens) <= {20, 21, 99}
        assert result.content == b"".join({20: b"x", 21: b"\xc3\xa9", 99: b""}[t] for t in tokens)
        if 99 in tokens:  # an EOG the server never drew still ends the generation
            assert tokens[-1] == 99 and tokens.count(99) == 1 and result.stop_type == "eos"
            ended_by_eog += 1
        else:
            assert result.stop_type == "limit" and len(tokens) == 12
    assert ended_by_eog > 0  # p(EOG) = 0.2 per token: 20 runs of 12 tokens hit it


async def test_engine_sampling_is_reproducible_per_seed_and_reports_statistics():
    first = await _sample(5)
    again = await _sample(5)
    other = await _sample(6)
    assert [e.token for e in first[0]] == [e.token for e in again[0]]
    assert [b[2] for b in first[2].bodies] == [b[2] for b in again[2].bodies]  # server seeds
    assert [b[2] for b in first[2].bodies] != [b[2] for b in other[2].bodies]
    result, metrics = first[1], first[3]
    assert result.sampled and "draft_n_accepted_greedy_match" in result.timings()
    assert result.timings()["draft_n_accepted_greedy_match"] == result.draft_n_matched
    assert metrics.sampled_draft_tokens == result.draft_n > 0
    assert metrics.sampled_accepted_tokens == result.draft_n_accepted
    assert metrics.sampled_matched_tokens == result.draft_n_matched
    page = metrics.render()
    assert f"npu_spec_sampled_greedy_match_tokens_total {result.draft_n_matched}" in page
    assert f"npu_spec_sampled_accepted_tokens_total {result.draft_n_accepted}" in page


# -- the drafter guard passes q through and checks ids ----------------------------------


async def test_guarded_drafter_samples_and_checks_ids():
    from proxy.drafter_guard import DrafterGarbage, DrafterSupervisor

    class Garbage(FixedDrafter):
        async def draft_sampled(self, committed, k, sampling, rng):
            return Draft([10**9], [1.0], [self.q])

    class GreedyOnly(DrafterBase):
        async def propose(self, committed, k):
            return [3] * k

        async def close(self):
            pass

    rng = np.random.default_rng(0)

    async def guarded_sample(supervisor: DrafterSupervisor, k: int) -> Draft:
        drafter = await supervisor.open()
        assert drafter is not None
        call = drafter.draft_sampled([1], k, None, rng)  # type: ignore[arg-type]
        return await supervisor.bounded(call, k, lambda d: d.tokens)

    supervisor = DrafterSupervisor(FixedDrafter, n_vocab=100)
    draft = await guarded_sample(supervisor, 2)
    assert len(draft.tokens) == 2 and draft.dists[0] is not None
    supervisor = DrafterSupervisor(GreedyOnly, n_vocab=100)
    draft = await guarded_sample(supervisor, 2)
    assert draft.tokens == [3, 3] and draft.dists is None  # no q: the point-mass rule
    supervisor = DrafterSupervisor(Garbage, n_vocab=100)
    with pytest.raises(DrafterGarbage):
        await guarded_sample(supervisor, 1)
    assert supervisor.failures == 1
