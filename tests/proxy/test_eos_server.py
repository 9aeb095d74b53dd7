"""EOS against the real server: the proxy stops on the token where llama-server stops.

The factory's `eos_boost` target ends greedy generations by `<|im_end|>` after a few
dozen tokens, so EOS lands inside accepted draft runs (same draft: the drafter
proposes EOS itself and must not continue past it) and as the server's correction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio

from proxy.server.llama_server import LlamaServerProcess
from proxy.server.managed import ServerLayout, managed_server
from tests.proxy.conftest import CTX, LOG_DIR, run_proxy
from tests.proxy.helpers import assert_greedy_equal, parse_sse, post_json, server_pair, tokenize

pytestmark = pytest.mark.server

EOS_BOOST = 2.5
PROMPTS = [
    "Hello, my name is",
    "def fibonacci(n):\n    ",
    "The capital of France is Paris. The capital of Germany is",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def eos_models(make_models_dir) -> Path:
    return make_models_dir("same", eos_boost=EOS_BOOST)


@pytest_asyncio.fixture(scope="module")
async def eos_servers(llama_server_bin: Path, eos_models: Path, tmp_path_factory):
    ref = LlamaServerProcess(
        llama_server_bin,
        eos_models / "target.gguf",
        ["-t", "1", "-c", str(CTX), "-np", "1"],
        log_path=LOG_DIR / "eos-ref-server.log",
    )
    spec = managed_server(
        eos_models / "target.gguf",
        ServerLayout(k=4, ctx_per_conversation=CTX, conversations=1, passthrough_slots=1),
        binary=llama_server_bin,
        threads=1,
        slot_save_dir=tmp_path_factory.mktemp("eos-slots"),
        log_path=LOG_DIR / "eos-spec-server.log",
    )
    async with server_pair(ref, spec) as urls:
        yield urls


def _drafter(eos_models: Path):
    from proxy.engine import AsyncSessionDrafter
    from tests.support.reference import ReferenceDraftModel

    model = ReferenceDraftModel.from_hf(eos_models / "draft-hf", max_context=CTX + 16)
    return lambda: AsyncSessionDrafter(model.open_session())


@pytest.mark.parametrize("k", [1, 4])
async def test_eos_stops_where_the_server_stops(http, eos_servers, eos_models, k) -> None:
    ref_url, spec_url = eos_servers
    ended_by_eos = 0
    # plain runs off: every answer is the engine's (a drafter measured too slow for this
    # tiny model would send later requests through to the server whole)
    async with run_proxy(spec_url, _drafter(eos_models), k, plain_runs="off") as proxy:
        for text in PROMPTS:
            body = {"prompt": text, "n_predict": 120, "temperature": 0, "return_tokens": True}
            expected = await post_json(http, ref_url + "/completion", body)
            status, got, headers = await proxy.post("/completion", body)
            assert status == 200 and headers["X-Npu-Spec"] == "speculative"
            prompt = await tokenize(http, ref_url, text)
            compared = await assert_greedy_equal(
                http, ref_url, prompt, expected["tokens"], got["tokens"]
            )
            if compared == len(expected["tokens"]):  # no near-tie flip: whole answer equal
                assert got["content"] == expected["content"]
                assert got["stop_type"] == expected["stop_type"]
                assert got["tokens_predicted"] == expected["tokens_predicted"]
            ended_by_eos += expected["stop_type"] == "eos"
    # The boosted model must really end by EOS, or this test would prove nothing.
    assert ended_by_eos >= 3, f"only {ended_by_eos} of {len(PROMPTS)} answers ended by EOS"


async def test_eos_in_streams(http, eos_servers, eos_models) -> None:
    ref_url, spec_url = eos_servers
    body = {"prompt": PROMPTS[3], "n_predict": 120, "temperature": 0, "stream": True}
    async with http.post(ref_url + "/completion", json=body) as response:
        expected, _ = parse_sse(await response.read())
    async with (
        run_proxy(spec_url, _drafter(eos_models), 4) as proxy,
        proxy.session.post(proxy.url + "/completion", json=body) as response,
    ):
        got, _ = parse_sse(await response.read())
    assert expected[-1]["stop_type"] == "eos"
    assert "".join(e["content"] for e in got) == "".join(e["content"] for e in expected)
    assert got[-1]["stop_type"] == "eos" and got[-1]["stop"] is True
