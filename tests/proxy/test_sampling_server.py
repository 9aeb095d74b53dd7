"""Sampling through the proxy has llama-server's own distribution, against real servers.

The statistical tests compare the proxy's empirical joint distribution of the first
two generated tokens with the EXACT distribution llama-server alone samples from:
its post-sampling probabilities (n_probs, post_sampling_probs) for the first token,
and for the second token after each possible first one.

Test design (Pearson chi-square goodness of fit, cells expected < 5 pooled):
- false-failure rate: ALPHA = 1e-3 per test; Bonferroni over the 3 tests bounds
  the suite's false-failure rate by 3e-3.
- power: a total-variation error eps gives noncentrality lambda = n * chi2(p'||p)
  >= n * (2 eps)^2 (Cauchy-Schwarz), the worst case over all ways to spread the
  error. With top_k 4 at each of two positions the pooled table has df <= 15
  (<= 8 in practice: some cells pool). Power at eps = 0.05, by Monte Carlo of the
  noncentral chi-square, alpha = 1e-3:
      n = 4000 (lambda >= 40): df 3 -> 0.99, df 8 -> 0.97, df 15 -> 0.90
      n = 3000 (lambda >= 30): df 3 -> 0.95, df 8 -> 0.85, df 15 -> 0.71
  so N_SAMPLES = 4000 detects a 5% total-variation error with probability >= 0.9
  whatever its shape.
Each sample is one generation with its own seed (n_predict 2, so k = 1 in the first
round: accept, residual and bonus draws are all exercised), run straight through
the engine, twelve at a time (see WORKERS). The draft token is
drawn from the real draft model's q after the prompt (computed once: see
FixedQDrafter), so a sample costs one or two verify rounds; the drafters' own
sampling path is exercised by the seeded test below.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from npu_draft.protocol import Draft, SamplingParams, SparseDist
from npu_draft.sampling import sampling_distribution
from proxy.api.requests import parse_completion
from proxy.data.sampling import SamplingSpec
from proxy.engine import AsyncSessionDrafter, EngineSettings, Generation, GenerationParams
from proxy.engine.drafting import DrafterBase
from proxy.engine.server_text import PieceCache
from proxy.server.upstream import UpstreamClient
from tests.proxy.conftest import CTX, run_proxy
from tests.proxy.helpers import post_json, tokenize
from tests.proxy.sampling_stats import chi_square_gof

pytestmark = [pytest.mark.server, pytest.mark.slow]

ALPHA = 1e-3
N_SAMPLES = int(os.environ.get("NPU_SPEC_SAMPLING_N", "4000"))
WORKERS = 12  # concurrent generations: 24 prompts queue for 13 slots, within the
# server's 15 HTTP threads; the batches they make amortise the 152k-row output head

# (draft variant, prompt, sampling parameters): two temperatures, a top_p and a min_p
# variant; top_k 4 keeps the table at <= 16 cells (power above). The noisy and
# unrelated drafts have q != p: rejections and residual draws happen.
CASES = [
    ("same", "Once upon a time", {"temperature": 0.6, "top_k": 4, "top_p": 1.0, "min_p": 0.0}),
    ("noisy:0.05", "The capital of France is",
     {"temperature": 1.0, "top_k": 4, "top_p": 0.8, "min_p": 0.0}),
    ("unrelated", "def fibonacci(n):\n    ",
     {"temperature": 1.0, "top_k": 4, "top_p": 1.0, "min_p": 0.05}),
]  # fmt: skip


class FixedQDrafter(DrafterBase):
    """Drafts the first token from q: the real draft model's distribution after the
    prompt under the request's chain (npu_draft.sampling), drawn with the request's
    draft generator exactly as the drafters draw it. Every sample drafts after the
    same prompt, so q is computed once instead of thousands of times."""

    def __init__(self, prompt: list[int], q: SparseDist) -> None:
        self.prompt = prompt
        self.q = q

    async def propose(self, committed, k):
        raise AssertionError("sampling requests must draft through draft_sampled")

    async def draft_sampled(self, committed, k, sampling, rng) -> Draft:
        assert list(committed) == self.prompt and k == 1  # n_predict 2: one draft, first round
        index = int(rng.choice(len(self.q.ids), p=self.q.probs))
        return Draft([int(self.q.ids[index])], [float(self.q.probs[index])], [self.q])

    async def close(self) -> None:
        pass


def draft_q(folder: Path, prompt: list[int], chain: SamplingParams) -> SparseDist:
    from tests.support.reference import ReferenceDraftModel

    session = ReferenceDraftModel.from_hf(folder / "draft-hf", max_context=CTX).open_session()
    session.sync(prompt)
    return sampling_distribution(session.next_logits(), chain)


async def server_distributions(
    http: aiohttp.ClientSession, url: str, prompts: list[list[int]], params: dict
) -> list[dict[int, float]]:
    """llama-server's own post-sampling distribution after each prompt, as a client
    asks for it (its default sampler chain, the request's parameters)."""
    out: list[dict[int, float] | None] = [None] * len(prompts)
    for seed in range(20):  # a draw that ends inside a UTF-8 character hides the probs
        todo = [i for i, d in enumerate(out) if d is None]
        if not todo:
            break
        body = {
            "prompt": [prompts[i] for i in todo],
            "n_predict": 1,
            "n_probs": params["top_k"],
            "post_sampling_probs": True,
            "seed": seed,
            **params,
        }
        payload = await post_json(http, url + "/completion", body)
        results = payload if isinstance(payload, list) else [payload]
        for i, result in zip(todo, sorted(results, key=lambda r: r.get("index", 0)), strict=True):
            probs = result.get("completion_probabilities") or []
            if probs:
                out[i] = {int(c["id"]): float(c["prob"]) for c in probs[0]["top_probs"]}
    assert all(d is not None for d in out), "the server never returned probabilities"
    return [{t: p / sum(d.values()) for t, p in d.items()} for d in out if d is not None]


async def exact_joint(
    http: aiohttp.ClientSession, ref_url: str, prompt: list[int], params: dict, eog: frozenset
) -> dict[tuple, float]:
    """P(first two tokens) under llama-server alone; an EOG first token ends it."""
    (first,) = await server_distributions(http, ref_url, [prompt], params)
    seconds = await server_distributions(http, ref_url, [[*prompt, a] for a in first], params)
    joint: dict[tuple, float] = {}
    for (a, pa), second in zip(first.items(), seconds, strict=True):
        if a in eog:
            joint[(a,)] = pa
        else:
            for b, pb in second.items():
                joint[(a, b)] = pa * pb
    return joint


async def proxy_samples(
    spec_url: str, drafter: FixedQDrafter, spec: SamplingSpec, n: int
) -> tuple[Counter, Counter]:
    """n generations of two tokens through the engine, seeds 0..n-1."""
    upstream = UpstreamClient(spec_url)
    pieces = PieceCache(upstream)
    n_ctx = int((await upstream.props())["default_generation_settings"]["n_ctx"])
    seeds = iter(range(n))
    counts: Counter = Counter()
    stats: Counter = Counter()

    async def worker() -> None:
        for seed in seeds:
            params = GenerationParams(n_predict=2, sampling=replace(spec, seed=seed))
            generation = Generation(
                upstream, drafter.prompt, params, n_ctx, drafter, pieces,
                settings=EngineSettings(k=1),
            )  # fmt: skip
            async for _ in generation.run():
                pass
            result = generation.result
            assert result is not None
            counts[tuple(result.tokens)] += 1
            stats.update(
                drafted=result.draft_n,
                accepted=result.draft_n_accepted,
                matched=result.draft_n_matched,
            )

    try:
        await asyncio.gather(*(worker() for _ in range(WORKERS)))
    finally:
        await upstream.close()
    return counts, stats


def onnx_drafter(folder: Path):
    from npu_draft.load import load_drafter

    if not (folder / "draft").is_dir():
        pytest.fail(f"no exported drafter folder at {folder / 'draft'}")
    model = load_drafter(folder / "draft", "cpu", backend="onnx", max_context=CTX + 16, threads=1)
    return lambda: AsyncSessionDrafter(model.open_session())


@pytest.mark.parametrize(("draft", "text", "params"), CASES, ids=[c[0] for c in CASES])
async def test_first_two_tokens_have_the_servers_distribution(
    http, ref_server, spec_server, make_models_dir, draft, text, params
):
    prompt = await tokenize(http, ref_server, text)
    upstream = UpstreamClient(spec_server)
    try:
        defaults = (await upstream.props())["default_generation_settings"]["params"]
        eog = await upstream.eog_tokens()
    finally:
        await upstream.close()
    # the request's own path to the engine's parameters
    _, request = parse_completion({"prompt": prompt, "n_predict": 2, **params}, defaults, False)
    assert request.sampling is not None, "a sampling request must take the speculative path"

    joint = await exact_joint(http, ref_server, prompt, params, eog)
    q = draft_q(make_models_dir(draft), prompt, request.sampling.chain)
    drafter = FixedQDrafter(prompt, q)
    counts, stats = await proxy_samples(spec_server, drafter, request.sampling, N_SAMPLES)

    result = chi_square_gof(counts, joint)
    print(f"{draft}: chi2 {result.statistic:.1f}, df {result.df}, p {result.p_value:.3f}, {stats}")
    assert not result.impossible, f"outcomes llama-server alone cannot produce: {result.impossible}"
    assert result.p_value > ALPHA, (
        f"chi2 = {result.statistic:.1f} on {result.df} df, p = {result.p_value:.2e}; "
        f"acceptance {stats}"
    )
    # the draft is really used: the same model is accepted nearly always, and the
    # rule keeps at least what matching the server's own draws would
    assert stats["drafted"] >= N_SAMPLES
    if draft == "same":
        assert stats["accepted"] >= 0.95 * stats["drafted"], stats
    assert stats["accepted"] >= stats["matched"] * 0.9, stats


async def test_seeded_request_reproduces_through_the_proxy(http, spec_server, make_models_dir):
    """The same seed gives the same tokens on every run; other seeds differ."""
    body = {
        "prompt": "Once upon a time",
        "n_predict": 24,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.0,
        "return_tokens": True,
    }
    outputs: dict[int, list[list[int]]] = {}
    for _ in range(2):  # a fresh proxy each time: nothing carries over but the seed
        drafter = onnx_drafter(make_models_dir("noisy:0.05"))
        async with run_proxy(spec_server, drafter, 2) as proxy:
            for seed in (7, 8, 7):
                status, got, headers = await proxy.post("/completion", {**body, "seed": seed})
                assert status == 200, got
                assert headers["X-Npu-Spec"] == "speculative"
                assert got["timings"]["draft_n"] > 0
                assert "draft_n_accepted_greedy_match" in got["timings"]
                outputs.setdefault(seed, []).append(got["tokens"])
            page = proxy.state.metrics.render()
            assert "npu_spec_sampled_greedy_match_tokens_total" in page
            assert proxy.state.metrics.sampled_draft_tokens > 0
    assert len(outputs[7]) == 4 and all(t == outputs[7][0] for t in outputs[7])
    assert all(t == outputs[8][0] for t in outputs[8])
    assert outputs[7][0] != outputs[8][0]
    assert len(outputs[7][0]) == 24
