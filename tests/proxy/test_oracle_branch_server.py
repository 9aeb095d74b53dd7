"""The oracle through the real engine and llama-server: where the target leaves the
recorded reference at a branch point, the oracle follows the recorded branch (no round
without a draft) instead of going silent for the rest of the answer."""

from __future__ import annotations

import pytest

from npu_draft.oracle import Branch, OracleConfig, OracleDraftModel
from proxy.engine import AsyncSessionDrafter, EngineSettings, GenerationParams
from proxy.server.upstream import UpstreamClient
from tests.proxy.helpers import generate, post_json, tokenize

pytestmark = [pytest.mark.server, pytest.mark.slow]

N_PREDICT = 30
FORK = 8  # where the recorded reference and the target part


async def _empty_rounds(spec_server: str, prompt: list[int], model: OracleDraftModel, truth):
    """Rounds without a draft (the last round left out: nothing may be left to draft)."""
    async with UpstreamClient(spec_server) as upstream:
        tokens, result = await generate(
            upstream,
            prompt,
            GenerationParams(n_predict=N_PREDICT),
            AsyncSessionDrafter(model.open_session()),
            settings=EngineSettings(k=2, adaptive=False),
        )
    assert tokens == truth  # lossless whatever the oracle drafts
    return sum(r.n_drafted == 0 for r in result.rounds[:-1])


async def test_the_oracle_follows_the_branch_the_target_takes(spec_server, http, ref_server):
    prompt = await tokenize(http, ref_server, "Once upon a time")
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "return_tokens": True}
    truth = (await post_json(http, ref_server + "/completion", body))["tokens"]
    assert len(truth) == N_PREDICT
    # A reference the target leaves at FORK (as a flipped near-tie would make it), with
    # the target's own output recorded as the branch after the "runner-up" truth[FORK].
    other = truth[FORK] + 1
    recorded = [*truth[:FORK], other, *truth[FORK + 1 :]]
    branch = Branch(FORK, truth[FORK], tuple(truth[FORK + 1 :]))
    config = OracleConfig(acceptance=1.0, vocab_size=151936)
    with_branch = OracleDraftModel([(prompt, recorded, [branch])], config)
    without = OracleDraftModel([(prompt, recorded)], config)
    assert await _empty_rounds(spec_server, prompt, with_branch, truth) == 0
    assert await _empty_rounds(spec_server, prompt, without, truth) >= 3
