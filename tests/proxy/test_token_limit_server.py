"""A token limit beyond the context is capped silently, as docs/CLIENTS.md says: the
answer stops where the context is full, with finish_reason "length", through the
speculative path exactly as from llama-server alone."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import CTX, run_proxy
from tests.proxy.helpers import post_json, tokenize

pytestmark = [pytest.mark.server]

LEFT = 40  # tokens of context left after the prompt


async def test_max_tokens_beyond_the_context_ends_with_length(
    http, ref_server, spec_server, reference_drafter
) -> None:
    words = "the cat sat on the mat " * 200
    tokens = await tokenize(http, ref_server, words)
    prompt = tokens[: CTX - LEFT]
    body = {"prompt": prompt, "max_tokens": 2**31 - 1, "temperature": 0}
    expected = await post_json(http, ref_server + "/v1/completions", body)
    async with run_proxy(spec_server, reference_drafter, 2, plain_runs="off") as proxy:
        status, got, headers = await proxy.post("/v1/completions", body)
    assert status == 200 and headers["X-Npu-Spec"] == "speculative", got
    for answer in (got, expected):
        assert answer["choices"][0]["finish_reason"] == "length"
        assert 0 < answer["usage"]["completion_tokens"] <= LEFT
    # both stop where the context is full (the text itself is compared elsewhere,
    # with near-ties accounted for)
    assert got["usage"] == expected["usage"]
