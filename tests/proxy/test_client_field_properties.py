"""The eligibility decision against llama-server's own behaviour, over random mixes
of neutral and non-neutral sampling fields (hypothesis, derandomized).

- Decided greedy: the server, given the same fields, must draw from a point mass
  (post-sampling probability 1 at every step) and write exactly its plain greedy
  tokens (temperature 0, nothing else).
- Decided mirrored sampling: the server's post-sampling distribution at every step
  must equal the one it computes for the chain the engine mirrors (top_k -> top_p ->
  min_p -> temperature with the decided values), with the same seed, so the draws
  stay aligned.
- Decided pass-through: nothing to check; the server answers itself.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.api.requests import NotEligible, parse_completion
from tests.proxy.helpers import post_json

pytestmark = [pytest.mark.server]

PROMPT = "The quick brown fox jumps over"
N_PREDICT = 5
SEED = 4242

# For each field: values that are no-ops (or argmax-preserving) and values that are not.
FIELD_VALUES: dict[str, list] = {
    "repeat_penalty": [1.0, 1.5],
    "presence_penalty": [0.0, 1.0],
    "frequency_penalty": [0.0, 1.0],
    "repeat_last_n": [0, 64],
    "dry_multiplier": [0.0, 1.5],
    "xtc_probability": [0.0, 1.0],
    "xtc_threshold": [0.1, 0.6],
    "typical_p": [1.0, 0.3],
    "typ_p": [1.0, 0.3],
    "dynatemp_range": [0.0, 0.7],
    "top_n_sigma": [-1.0, 1.0],
    "top_k": [0, 1, 5, 40],
    "top_p": [1.0, 0.8],
    "min_p": [0.0, 0.1],
    "logit_bias": [{}, [], {"15": 4.0}],
    "samplers": [
        "kt", "edskypmxt", "kypmt", "tk", "pt",
        ["top_k", "temperature"], ["top_p", "min_p", "temperature"], ["top_k"],
    ],
    "timings_per_token": [True],
    "reasoning_control": [True],
}  # fmt: skip

fields = st.dictionaries(st.sampled_from(sorted(FIELD_VALUES)), st.integers(0, 3), max_size=5).map(
    lambda picks: {k: FIELD_VALUES[k][i % len(FIELD_VALUES[k])] for k, i in picks.items()}
)

_decisions: Counter[str] = Counter()


def probe(body: dict, n_probs: int) -> dict:
    return {
        "prompt": PROMPT, "n_predict": N_PREDICT, "seed": SEED, "n_probs": n_probs,
        "post_sampling_probs": True, "return_tokens": True, **body,
    }  # fmt: skip


def distributions(payload: dict) -> list[dict[int, float]]:
    return [
        {p["id"]: p["prob"] for p in step["top_probs"]}
        for step in payload["completion_probabilities"]
    ]


@settings(
    derandomize=True,
    deadline=None,
    max_examples=30,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=fields, temperature=st.sampled_from([0.0, 0.7]))
async def test_decision_matches_the_servers_sampling(http, ref_server, body, temperature):
    body = {**body, "temperature": temperature}
    props = await _props(http, ref_server)
    try:
        _, params = parse_completion({"prompt": PROMPT, **body}, props, oai=False)
    except NotEligible:
        _decisions["pass-through"] += 1
        return
    url = ref_server + "/completion"
    if params.sampling is None:
        _decisions["greedy"] += 1
        got = await post_json(http, url, probe(body, 1))
        greedy = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0}
        plain = await post_json(http, url, {**greedy, "return_tokens": True})
        assert got["tokens"] == plain["tokens"], body
        assert all(d and max(d.values()) == 1.0 for d in distributions(got)), body
        return
    _decisions["mirrored sampling"] += 1
    chain = params.sampling.chain
    mirrored = {
        "temperature": chain.temperature, "top_k": chain.top_k, "top_p": chain.top_p,
        "min_p": chain.min_p, "min_keep": params.sampling.min_keep,
        "samplers": ["top_k", "top_p", "min_p", "temperature"],
    }  # fmt: skip
    got = await post_json(http, url, probe(body, chain.top_k))
    want = await post_json(http, url, probe(mirrored, chain.top_k))
    assert got["tokens"] == want["tokens"], body
    for step, (have, expect) in enumerate(
        zip(distributions(got), distributions(want), strict=True)
    ):
        assert have.keys() == expect.keys(), (body, step)
        assert all(abs(have[t] - expect[t]) <= 1e-6 for t in have), (body, step)


_props_cache: dict[str, dict] = {}


async def _props(http, base: str) -> dict:
    if base not in _props_cache:
        async with http.get(base + "/props") as response:
            _props_cache[base] = (await response.json())["default_generation_settings"]["params"]
    return _props_cache[base]


def test_every_kind_of_decision_was_checked():
    # runs after the property above (file order): each outcome must have occurred
    print(f"decisions checked against the server: {dict(_decisions)}")
    assert {"greedy", "mirrored sampling", "pass-through"} <= set(_decisions), _decisions
