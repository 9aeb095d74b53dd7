"""OpenAI routes, pass-through, concurrency, disconnects and errors, against real servers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from proxy.api import ProxyState, create_app
from proxy.engine.drafting import DrafterBase
from proxy.metrics import ProxyMetrics
from proxy.policies.load import LoadGate, LoadMeasures
from proxy.server.upstream import UpstreamClient
from proxy.slot_share import SlotShare
from tests.proxy.conftest import run_proxy
from tests.proxy.helpers import (
    assert_greedy_equal,
    chat_prompt_tokens,
    parse_sse,
    post_json,
    proxy_settings,
    shape,
    stable_length,
    tokenize,
)

pytestmark = [pytest.mark.server]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers in Europe."},
]
# Values that differ between any two responses (time, ids, cache state).
VOLATILE = {"created", "id", "timings"}


def _comparable(body: dict) -> dict:
    body = {k: v for k, v in body.items() if k not in VOLATILE}
    if "usage" in body:
        usage = dict(body["usage"])
        usage.pop("prompt_tokens_details", None)  # cache hits differ between servers
        body["usage"] = usage
    return body


@pytest.mark.parametrize(
    "thinking", [None, False], ids=["default-template", "enable_thinking-false"]
)
async def test_chat_completion_equals_server(
    http, ref_server, spec_server, reference_drafter, thinking
):
    body = {"messages": MESSAGES, "temperature": 0}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    prompt = await chat_prompt_tokens(http, ref_server, body)
    body["max_tokens"] = await stable_length(http, ref_server, prompt, 48)
    assert body["max_tokens"] >= 8
    expected = await post_json(http, ref_server + "/v1/chat/completions", body)
    async with run_proxy(spec_server, reference_drafter, 4) as proxy:
        status, got, headers = await proxy.post("/v1/chat/completions", body)
    assert status == 200, got
    assert headers["X-Npu-Spec"] == "speculative"
    assert _comparable(got) == _comparable(expected)
    assert shape({k: v for k, v in got.items() if k != "timings"}) == shape(
        {k: v for k, v in expected.items() if k != "timings"}
    )
    assert got["id"].startswith("chatcmpl-") and len(got["id"]) == len(expected["id"])
    assert got["timings"]["draft_n"] >= got["timings"]["draft_n_accepted"] > 0


async def test_chat_stream_equals_server(http, ref_server, spec_server, reference_drafter):
    body = {
        "messages": MESSAGES,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = await chat_prompt_tokens(http, ref_server, body)
    body["max_tokens"] = await stable_length(http, ref_server, prompt, 32)
    assert body["max_tokens"] >= 8
    async with http.post(ref_server + "/v1/chat/completions", json=body) as response:
        expected, expected_done = parse_sse(await response.read())
    async with (
        run_proxy(spec_server, reference_drafter, 4) as proxy,
        proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["X-Npu-Spec"] == "speculative"
        got, done = parse_sse(await response.read())
    assert done and expected_done
    assert [_comparable(e) for e in got] == [_comparable(e) for e in expected]
    assert "timings" in got[-1] and "usage" in got[-1]
    assert len({e["id"] for e in got}) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_oai_completion_equals_server(
    http, ref_server, spec_server, reference_drafter, stream
):
    body = {"prompt": "In a hole in the ground", "temperature": 0, "stream": stream}
    prompt = await tokenize(http, ref_server, body["prompt"])
    body["max_tokens"] = await stable_length(http, ref_server, prompt, 40)
    assert body["max_tokens"] >= 8
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        if stream:
            async with http.post(ref_server + "/v1/completions", json=body) as response:
                expected, expected_done = parse_sse(await response.read())
            async with proxy.session.post(proxy.url + "/v1/completions", json=body) as response:
                got, done = parse_sse(await response.read())
            assert done and expected_done
            assert [_comparable(e) for e in got] == [_comparable(e) for e in expected]
        else:
            expected = await post_json(http, ref_server + "/v1/completions", body)
            status, got, _ = await proxy.post("/v1/completions", body)
            assert status == 200
            assert _comparable(got) == _comparable(expected)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/props", None),
        ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}),
        ("POST", "/detokenize", {"tokens": [9707, 1879]}),
        ("POST", "/apply-template", {"messages": MESSAGES}),
    ],
)
async def test_passthrough_is_byte_identical(spec_server, reference_drafter, method, path, body):
    """The proxy's answer equals, byte for byte, a direct answer asked just before or
    just after it: /v1/models carries the server's current second (`created`), so
    the proxied request may fall in either of two seconds."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json"}

    async def direct(session) -> tuple[int, bytes]:
        async with session.request(method, spec_server + path, data=data, headers=headers) as r:
            return r.status, await r.read()

    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        before = await direct(proxy.session)
        async with proxy.session.request(method, proxy.url + path, data=data, headers=headers) as r:
            got = r.status, await r.read()
            assert r.headers["X-Npu-Spec"] == "passthrough"
        after = await direct(proxy.session)
    assert got in (before, after)


@pytest.mark.parametrize(
    "extra",
    [
        {"grammar": 'root ::= "a" [a-z]*'},
        {"temperature": 0.8, "seed": 7, "typical_p": 0.9},  # a sampler not mirrored
        {"n_probs": 3},
        {"json_schema": {"type": "object"}},
    ],
    ids=["grammar", "sampling", "n_probs", "json_schema"],
)
async def test_requests_the_engine_cannot_serve_pass_through(
    http, spec_server, reference_drafter, extra
):
    """Streamed, with a fixed seed: same events as the server answers directly."""
    body = {"prompt": "Hello", "n_predict": 12, "temperature": 0, "stream": True, **extra}
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        async with http.post(spec_server + "/completion", json=body) as response:
            expected, _ = parse_sse(await response.read())
        async with proxy.session.post(proxy.url + "/completion", json=body) as response:
            assert response.headers["X-Npu-Spec"] == "passthrough"
            got, _ = parse_sse(await response.read())
        assert proxy.state.metrics.rounds == 0
    strip = lambda events: [{k: v for k, v in e.items() if k != "timings"} for e in events]  # noqa: E731
    assert strip(got) == strip(expected)


async def test_four_concurrent_conversations_each_equal_to_solo(
    http, ref_server, spec_server, reference_drafter
):
    prompts = ["The river", "Numbers: 1, 2, 3,", "import numpy as np\n", "Dear Sir,"]
    bodies = [
        {"prompt": p, "n_predict": 24 + 4 * i, "temperature": 0, "return_tokens": True}
        for i, p in enumerate(prompts)
    ]
    solo = [await post_json(http, ref_server + "/completion", b) for b in bodies]
    # a load gate that measured batching as free: all four speculate at once (by
    # default only the first would, the others passing through to llama-server)
    free_batches = LoadGate("auto", lambda: LoadMeasures(10.0, 5.0, 0.0))
    share = SlotShare(13, 3, gate=free_batches)  # the spec server's 13 slots, k=2
    async with run_proxy(spec_server, reference_drafter, 2, scheduler=share) as proxy:
        results = await asyncio.gather(*(proxy.post("/completion", b) for b in bodies))
        assert share.idle()
        assert sum(1 for e, _ in share.events if e == "speculative") == 4
    for prompt, expected, (status, got, headers) in zip(prompts, solo, results, strict=True):
        assert status == 200 and headers["X-Npu-Spec"] == "speculative"
        tokens = await tokenize(http, ref_server, prompt)
        await assert_greedy_equal(http, ref_server, tokens, expected["tokens"], got["tokens"])


async def test_client_disconnect_cancels_and_frees_slots(spec_server, reference_drafter):
    body = {"prompt": "A long story:", "n_predict": 600, "temperature": 0, "stream": True}
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        session = aiohttp.ClientSession()
        response = await session.post(proxy.url + "/completion", json=body)
        await response.content.readline()  # the first event arrived: generation runs
        assert proxy.state.scheduler.active == 1
        response.close()
        await session.close()
        for _ in range(100):
            if proxy.state.scheduler.active == 0:
                break
            await asyncio.sleep(0.05)
        assert proxy.state.scheduler.active == 0
        async with UpstreamClient(spec_server) as upstream:
            for _ in range(100):
                slots = await upstream.slots()
                if not any(slot["is_processing"] for slot in slots):
                    break
                await asyncio.sleep(0.05)
            assert not any(slot["is_processing"] for slot in slots)
        generated = proxy.state.metrics.generated_tokens
        assert generated < 600  # stopped, not run to the end


async def test_unreachable_upstream_is_503_naming_it():
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    props = {"default_generation_settings": {"params": {"temperature": 0.0}, "n_ctx": 512}}
    upstream = UpstreamClient(dead)
    state = ProxyState(
        upstream=upstream,
        settings=proxy_settings(dead, k=1),
        scheduler=SlotShare(4, 2),
        metrics=ProxyMetrics(),
        props=props,
        open_drafter=lambda: None,
        settings_template={},
    )
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(create_app(state))) as client:
        for path, body in [
            ("/completion", {"prompt": "hi", "n_predict": 3, "temperature": 0}),
            ("/v1/models", None),
        ]:
            response = await client.request("POST" if body else "GET", path, json=body)
            payload = await response.json()
            assert response.status == 503, payload
            assert dead in payload["error"]["message"]
            assert payload["error"]["type"] == "unavailable_error"
    await upstream.close()


class _FailingDrafter(DrafterBase):
    async def propose(self, committed, k):
        raise RuntimeError("NPU fell over")

    async def close(self):
        pass


async def test_drafter_failure_falls_back_to_plain_decoding(http, ref_server, spec_server):
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0, "return_tokens": True}
    expected = await post_json(http, ref_server + "/completion", body)
    async with run_proxy(spec_server, _FailingDrafter, 4) as proxy:
        status, got, headers = await proxy.post("/completion", body)
        metrics_page = await (await proxy.session.get(proxy.url + "/metrics")).text()
    assert status == 200 and headers["X-Npu-Spec"] == "speculative"
    tokens = await tokenize(http, ref_server, body["prompt"])
    await assert_greedy_equal(http, ref_server, tokens, expected["tokens"], got["tokens"])
    assert "npu_spec_drafter_failures_total 1" in metrics_page
    assert "draft_n" not in got["timings"]


async def test_metrics_page(spec_server, reference_drafter):
    body = {"prompt": "Metrics", "n_predict": 20, "temperature": 0}
    # plain runs off: rounds only (the gate would measure a plain run early); fixed k:
    # the draft-length sweep would start at one draft
    async with run_proxy(
        spec_server, reference_drafter, 4, plain_runs="off", adaptive_k=False
    ) as proxy:
        await proxy.post("/completion", body)
        async with proxy.session.get(proxy.url + "/metrics") as response:
            page = await response.text()
    rounds = proxy.state.metrics.rounds
    assert rounds == 4  # 20 tokens, 5 per round with every draft accepted
    assert f"npu_spec_rounds_total {rounds}" in page
    assert "npu_spec_draft_tokens_total 16" in page
    assert "npu_spec_accepted_tokens_total 16" in page
    for position in range(4):
        assert f'npu_spec_accepted_tokens_per_position_total{{position="{position}"}} 4' in page
    for name in ("draft_ms", "verify_ms", "overhead_ms", "tokens_per_second"):
        assert f"npu_spec_{name}_count" in page
    assert "llamacpp:n_decode_total" in page  # the server's own counters follow


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": "x", "n_predict": "many"}, "n_predict"),
        ({"prompt": 12, "n_predict": 2}, "prompt"),
        ({"messages": "hello", "max_tokens": 2}, "messages"),
    ],
)
async def test_bad_input_is_a_4xx_in_openai_format(
    http, spec_server, reference_drafter, body, fragment
):
    path = "/v1/chat/completions" if "messages" in body else "/completion"
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        async with proxy.session.post(proxy.url + path, json=body) as response:
            status, payload = response.status, await response.json()
        assert proxy.state.scheduler.active == 0
    assert 400 <= status < 500
    assert set(payload["error"]) >= {"code", "message", "type"}
    assert payload["error"]["code"] == status
