"""The proxy in front of a llama-server split across hosts by llama.cpp's RPC backend.

Two `ggml-rpc-server` processes on loopback (CPU backend) hold all the model's layers;
llama-server runs with `--rpc` to both and the managed-mode verification flags. Greedy
output through the proxy must equal that server's own output, one llama_decode per
verify round. The reference is the same server answering plainly: a ggml-rpc-server
serves one client at a time, so a second llama-server cannot share the two.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from proxy import doctor
from proxy.engine import EngineSettings, GenerationParams
from proxy.server.attach_check import check_upstream
from proxy.server.managed import managed_server
from proxy.server.rpc import (
    RpcServerNotFound,
    find_rpc_server,
    rpc_devices_in_log,
    rpc_flag,
    rpc_servers,
)
from proxy.server.upstream import UpstreamClient
from tests.proxy.conftest import LOG_DIR, SPEC_LAYOUT, run_proxy
from tests.proxy.helpers import (
    assert_greedy_equal,
    assert_rejections_are_near_ties,
    generate,
    post_json,
    record_rounds,
    recording,
    tokenize,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["Once upon a time", "def fibonacci(n):\n    "]


@dataclass
class RpcStack:
    url: str
    endpoints: list[str]
    log_path: Path


def _rpc_server_for(llama_server: Path) -> Path:
    """The ggml-rpc-server of the same build as llama-server, else any findable one;
    skip (with the reason) only when there is none."""
    sibling = llama_server.resolve().with_name("ggml-rpc-server")
    if sibling.is_file():
        return sibling
    try:
        return find_rpc_server()
    except RpcServerNotFound as error:
        pytest.skip(f"RPC binaries absent: {error}")


@pytest_asyncio.fixture(scope="module")
async def rpc_stack(
    llama_server_bin: Path, demo_models: Path, tmp_path_factory
) -> AsyncIterator[RpcStack]:
    binary = _rpc_server_for(llama_server_bin)
    async with rpc_servers(2, binary, threads=1, log_dir=LOG_DIR / "rpc") as servers:
        log_path = LOG_DIR / "rpc-spec-server.log"
        log_path.unlink(missing_ok=True)
        server = managed_server(
            demo_models / "target.gguf",
            SPEC_LAYOUT,
            binary=llama_server_bin,
            threads=1,
            slot_save_dir=tmp_path_factory.mktemp("rpc-slots"),
            # -lv 4: the log names the buffers each RPC device holds (checked below)
            extra_args=[*rpc_flag(servers), "-lv", "4"],
            log_path=log_path,
        )
        await server.start()
        try:
            yield RpcStack(server.base_url, [s.endpoint for s in servers], log_path)
        finally:
            await server.stop()


async def test_layers_live_on_both_rpc_servers(rpc_stack: RpcStack) -> None:
    """Without this the other tests could pass on a server that ignored --rpc."""
    devices = rpc_devices_in_log(rpc_stack.log_path.read_text(errors="replace"))
    for endpoint in rpc_stack.endpoints:
        assert any(f"[{endpoint}]" in device for device in devices), (endpoint, devices)


@pytest.mark.parametrize(("prompt_index", "n_predict", "k", "drafter"), [
    (0, 48, 4, "reference"),
    (1, 40, 4, "reference:noisy:0.05"),  # rejections: a different draft model
])  # fmt: skip
async def test_greedy_through_proxy_equals_rpc_server(
    http, rpc_stack: RpcStack, drafter_for, prompt_index, n_predict, k, drafter
) -> None:
    body = {
        "prompt": PROMPTS[prompt_index],
        "n_predict": n_predict,
        "temperature": 0,
        "return_tokens": True,
    }
    expected = await post_json(http, rpc_stack.url + "/completion", body)
    prompt = await tokenize(http, rpc_stack.url, PROMPTS[prompt_index])
    drafts: dict[int, list[int]] = {}
    async with run_proxy(
        rpc_stack.url, recording(drafter_for(drafter), drafts), k, check_decodes=True
    ) as proxy:
        rounds = record_rounds(proxy.state.metrics)
        status, got, headers = await proxy.post("/completion", body)
        assert status == 200, got
        assert headers["X-Npu-Spec"] == "speculative"
        await assert_greedy_equal(http, rpc_stack.url, prompt, expected["tokens"], got["tokens"])
        metrics = proxy.state.metrics
        assert metrics.rounds > 0 and metrics.draft_tokens > 0
        assert metrics.decode_check_failures == 0  # one llama_decode per verify round
        if drafter == "reference":  # the same weights: rejections only at proven near-ties
            rejected = await assert_rejections_are_near_ties(
                http, rpc_stack.url, prompt, got["tokens"], rounds, drafts
            )
            if not rejected:
                assert metrics.accepted_tokens == metrics.draft_tokens
        else:  # the noisy draft is rejected somewhere: corrections come from the server
            assert metrics.accepted_tokens < metrics.draft_tokens


async def test_engine_one_decode_per_round_over_rpc(
    http, rpc_stack: RpcStack, reference_drafter
) -> None:
    """Round by round: n_decode_total grows by exactly one per verify round."""
    prompt = await tokenize(http, rpc_stack.url, PROMPTS[1])
    expected = await post_json(
        http,
        rpc_stack.url + "/completion",
        {"prompt": prompt, "n_predict": 24, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(rpc_stack.url) as upstream:
        tokens, result = await generate(
            upstream,
            prompt,
            GenerationParams(n_predict=24),
            reference_drafter(),
            settings=EngineSettings(k=5, adaptive=False, check_decodes=True, strict_decodes=True),
        )
    await assert_greedy_equal(http, rpc_stack.url, prompt, expected["tokens"], tokens)
    assert result.rounds and [r.decodes for r in result.rounds] == [1] * len(result.rounds)


async def test_doctor_reports_rpc_split_as_ok(rpc_stack: RpcStack) -> None:
    lines = doctor.rpc_report(rpc_stack.url)
    assert len(lines) == 1 and lines[0].startswith("  [ok]"), lines
    assert all(endpoint in lines[0] for endpoint in rpc_stack.endpoints)
    findings = await check_upstream(rpc_stack.url, k=SPEC_LAYOUT.k)
    errors = [f.message for f in findings if f.severity == "error"]
    assert not errors, errors
