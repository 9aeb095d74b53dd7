"""Real clients' requests through the proxy, against llama-server alone: the web UI's,
Open WebUI's and LM Studio-style bodies, the OpenAI Python SDK, their start-up
probes, and what the responses carry (reasoning split, per-chunk timings, progress).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from npu_draft.llama_source import source_dir
from proxy.api.tool_calls import ToolTriggers
from proxy.server.llama_server import LlamaServerProcess
from proxy.server.managed import managed_server
from tests.proxy.client_bodies import greedy_client_bodies, web_ui
from tests.proxy.conftest import CTX, LOG_DIR, SPEC_LAYOUT, run_proxy
from tests.proxy.helpers import chat_prompt_tokens, parse_sse, post_json, server_pair, stable_length

pytestmark = [pytest.mark.server]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers in Europe."},
]
VOLATILE = {"created", "id", "timings"}


def comparable(body: dict) -> dict:
    """A response without what differs between any two servers (time, ids, cache)."""
    body = {k: v for k, v in body.items() if k not in VOLATILE}
    if "usage" in body:
        body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    if "prompt_progress" in body:
        body["prompt_progress"] = sorted(body["prompt_progress"])  # keys only
    return body


def split_progress(events: list[dict]) -> tuple[list[dict], list[dict]]:
    progress = [e for e in events if "prompt_progress" in e]
    return progress, [e for e in events if "prompt_progress" not in e]


async def model_id(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(base + "/v1/models") as response:
        return (await response.json())["data"][0]["id"]


async def bounded(http: aiohttp.ClientSession, ref: str, body: dict, n: int = 24) -> dict:
    """The body with a token limit that stops before any near-tie (so the comparison
    is exact), replacing whatever limit the client sent."""
    prompt = await chat_prompt_tokens(http, ref, body)
    body = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    body["max_tokens"] = await stable_length(http, ref, prompt, n)
    assert body["max_tokens"] >= 4
    return body


async def answer(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[object, dict]:
    """(response JSON or (events, done), headers) of one chat request."""
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if body.get("stream"):
            return parse_sse(await response.read()), dict(response.headers)
        return await response.json(), dict(response.headers)


def assert_same_stream(got: tuple[list[dict], bool], expected: tuple[list[dict], bool]) -> None:
    (events, done), (want, want_done) = got, expected
    assert done and want_done
    progress, rest = split_progress(events)
    want_progress, want_rest = split_progress(want)
    assert [comparable(e) for e in rest] == [comparable(e) for e in want_rest]
    # which chunks carry timings (all of them under timings_per_token)
    assert ["timings" in e for e in rest] == ["timings" in e for e in want_rest]
    if want_progress:  # before any token, ending with the whole prompt processed
        assert progress and events[: len(progress)] == progress
        assert [comparable(e) for e in progress] == [comparable(e) for e in want_progress][:1] * (
            len(progress)
        )
        last = progress[-1]["prompt_progress"]
        assert last["processed"] == last["total"] == want_progress[-1]["prompt_progress"]["total"]
    else:
        assert not progress


# -- the clients' ordinary chat requests -------------------------------------------

CLIENTS = sorted(greedy_client_bodies("m", MESSAGES))


@pytest.mark.parametrize("client", CLIENTS)
async def test_client_chat_is_speculative_and_equals_server(
    http, ref_server, spec_server, reference_drafter, client
):
    body = greedy_client_bodies(await model_id(http, ref_server), MESSAGES)[client]
    body = await bounded(http, ref_server, body)
    expected, _ = await answer(http, ref_server, body)
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        got, headers = await answer(proxy.session, proxy.url, body)
    assert headers["X-Npu-Spec"] == "speculative"
    if body.get("stream"):
        assert_same_stream(got, expected)
    else:
        assert comparable(got) == comparable(expected)


async def test_web_ui_default_settings_sample_speculatively(
    http, ref_server, spec_server, reference_drafter
):
    """The UI as shipped sends no temperature: the server's 0.8 applies, which the
    sampling mode mirrors (its distribution is checked by test_sampling_server.py)."""
    body = web_ui(MESSAGES) | {"max_tokens": 8}
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        (events, done), headers = await answer(proxy.session, proxy.url, body)
    assert headers["X-Npu-Spec"] == "speculative"
    assert done and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    progress, rest = split_progress(events)
    assert (
        progress
        and progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    )
    # under timings_per_token every token's last chunk carries the running timings
    deltas = [e for e in rest if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert deltas and all("timings" in e for e in deltas)


async def test_native_completion_with_samplers_top_k_is_greedy_and_speculative(
    http, ref_server, spec_server, reference_drafter
):
    body = {"prompt": "The capital of France is", "samplers": ["top_k"], "top_k": 1}
    body |= {"temperature": 0, "n_predict": 12, "return_tokens": True}
    expected = await post_json(http, ref_server + "/completion", body)
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        status, got, headers = await proxy.post("/completion", body)
    assert status == 200 and headers["X-Npu-Spec"] == "speculative"
    assert got["tokens"] == expected["tokens"] and got["content"] == expected["content"]


@pytest.mark.parametrize("route", ["/completion", "/v1/completions"])
async def test_timings_per_token_and_progress_on_text_routes(
    http, ref_server, spec_server, reference_drafter, route
):
    body = {"prompt": "Once upon a time", "temperature": 0, "stream": True}
    body |= {"timings_per_token": True, "return_progress": True, "max_tokens": 8}
    if route == "/completion":
        body["n_predict"] = body.pop("max_tokens")
    async with http.post(ref_server + route, json=body) as response:
        expected = parse_sse(await response.read())
    async with (
        run_proxy(spec_server, reference_drafter, 3) as proxy,
        proxy.session.post(proxy.url + route, json=body) as response,
    ):
        assert response.headers["X-Npu-Spec"] == "speculative"
        got = parse_sse(await response.read())
    if route == "/completion":  # the native route ends without [DONE]
        got, expected = (got[0], True), (expected[0], True)
    assert_same_stream(got, expected)


# -- the OpenAI Python SDK ----------------------------------------------------------

SDK_CASES = {
    "defaults": {},
    "stream-include-usage": {"stream": True, "stream_options": {"include_usage": True}},
    "seed": {"seed": 1234},
    "max_completion_tokens": {"max_completion_tokens": None},  # filled in below
    "response_format-text": {"response_format": {"type": "text"}},
    "penalties-0": {"frequency_penalty": 0, "presence_penalty": 0},
}


@contextlib.asynccontextmanager
async def sdk(base: str) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


async def sdk_chat(client: openai.AsyncOpenAI, kwargs: dict) -> tuple[dict, str]:
    raw = await client.chat.completions.with_raw_response.create(**kwargs)
    header = raw.headers.get("x-npu-spec", "")
    if kwargs.get("stream"):
        text, finish, usage = "", None, None
        async for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return {"text": text, "finish": finish, "usage": usage and usage.completion_tokens}, header
    done = raw.parse()
    choice = done.choices[0]
    return {
        "text": choice.message.content,
        "finish": choice.finish_reason,
        "usage": done.usage.completion_tokens,
    }, header


@pytest.mark.parametrize("case", sorted(SDK_CASES))
async def test_openai_sdk_chat_is_speculative_and_equals_server(
    http, ref_server, spec_server, reference_drafter, case
):
    model = await model_id(http, ref_server)
    limit = (await bounded(http, ref_server, {"messages": MESSAGES}))["max_tokens"]
    kwargs = {"model": model, "messages": MESSAGES, "temperature": 0, **SDK_CASES[case]}
    if "max_completion_tokens" in kwargs:
        kwargs["max_completion_tokens"] = limit
    else:
        kwargs["max_tokens"] = limit
    async with sdk(ref_server) as client:
        expected, _ = await sdk_chat(client, kwargs)
    async with run_proxy(spec_server, reference_drafter, 3) as proxy, sdk(proxy.url) as client:
        got, header = await sdk_chat(client, kwargs)
    assert header == "speculative"
    assert got == expected
    assert expected["text"]


async def test_openai_sdk_without_temperature_samples_speculatively(
    spec_server, reference_drafter, http, ref_server
):
    model = await model_id(http, ref_server)
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 8}
    async with run_proxy(spec_server, reference_drafter, 3) as proxy, sdk(proxy.url) as client:
        got, header = await sdk_chat(client, kwargs)
    assert header == "speculative" and got["finish"] in ("stop", "length")


async def test_openai_sdk_completions_is_speculative_and_equals_server(
    http, ref_server, spec_server, reference_drafter
):
    model = await model_id(http, ref_server)
    kwargs = {"model": model, "prompt": "In a hole in the ground", "temperature": 0}
    kwargs["max_tokens"] = 16
    async with sdk(ref_server) as client:
        expected = (await client.completions.create(**kwargs)).choices[0]
    async with run_proxy(spec_server, reference_drafter, 3) as proxy, sdk(proxy.url) as client:
        raw = await client.completions.with_raw_response.create(**kwargs)
        got = raw.parse().choices[0]
    assert raw.headers["x-npu-spec"] == "speculative"
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)


# -- start-up probes ----------------------------------------------------------------


async def test_client_probes_pass_through(http, spec_server, reference_drafter):
    """What the clients ask first: the model list (SDK, Open WebUI, LM Studio-style),
    /props and /slots (the web UI), /health."""
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        async with sdk(proxy.url) as client:
            models = await client.models.list()
        async with sdk(spec_server) as client:
            direct = await client.models.list()
        assert [m.id for m in models.data] == [m.id for m in direct.data]
        for path in ("/props", "/slots", "/health", "/v1/models", "/models"):
            async with http.get(spec_server + path) as response:
                want = response.status, await response.read()
            async with proxy.session.get(proxy.url + path) as response:
                got = response.status, await response.read()
                # /health is the proxy's own route, with the server's answer
                own = "proxy" if path == "/health" else "passthrough"
                assert response.headers["X-Npu-Spec"] == own
            assert got[0] == want[0] == 200, (path, got[0], want[0])
            if path != "/slots":  # slot states change between the two calls
                assert got == want, path


# -- reasoning ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_format_none_equals_server(
    http, ref_server, spec_server, reference_drafter, stream
):
    body = {"messages": MESSAGES, "temperature": 0, "stream": stream, "reasoning_format": "none"}
    body = await bounded(http, ref_server, body, 16)
    expected, _ = await answer(http, ref_server, body)
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        got, headers = await answer(proxy.session, proxy.url, body)
    assert headers["X-Npu-Spec"] == "speculative"
    if stream:
        assert_same_stream(got, expected)
    else:
        assert comparable(got) == comparable(expected)


# a template whose generation prompt opens a thinking block


@pytest.fixture(scope="module")
def thinking_template() -> Path:
    # QwQ's template ends the generation prompt with "<think>\n": everything the model
    # writes is reasoning until it closes the block, which the server's parser splits
    path = source_dir() / "models" / "templates" / "Qwen-QwQ-32B.jinja"
    assert path.is_file(), path
    return path


@pytest.fixture
async def thinking_servers(
    llama_server_bin, demo_models, thinking_template, tmp_path
) -> AsyncIterator[tuple[str, str]]:
    template_args = ["--chat-template-file", str(thinking_template)]
    ref = LlamaServerProcess(  # llama-server alone, as the ref_server fixture starts it
        llama_server_bin,
        demo_models / "target.gguf",
        ["-t", "1", "-c", str(CTX), "-np", "1", *template_args],
        log_path=LOG_DIR / "clients-thinking-ref.log",
    )
    spec = managed_server(
        demo_models / "target.gguf",
        SPEC_LAYOUT,
        binary=llama_server_bin,
        threads=1,
        slot_save_dir=tmp_path / "spec-slots",
        extra_args=template_args,
        log_path=LOG_DIR / "clients-thinking-spec.log",
    )
    async with server_pair(ref, spec) as urls:
        yield urls


async def test_reasoning_formats_split_as_the_server_does(
    http, thinking_servers, reference_drafter
):
    ref, spec = thinking_servers
    seen_reasoning = False
    # plain runs off: the engine writes every answer (a drafter measured too slow for
    # this tiny model would send requests through to the server whole)
    async with run_proxy(spec, reference_drafter, 3, plain_runs="off") as proxy:
        for reasoning_format in (None, "none", "auto", "deepseek"):
            for stream in (False, True):
                body = {"messages": MESSAGES, "temperature": 0, "stream": stream}
                if reasoning_format is not None:
                    body["reasoning_format"] = reasoning_format
                body = await bounded(http, ref, body, 16)
                expected, _ = await answer(http, ref, body)
                got, headers = await answer(proxy.session, proxy.url, body)
                assert headers["X-Npu-Spec"] == "speculative"
                where = f"reasoning_format={reasoning_format} stream={stream}"
                if stream:
                    assert_same_stream(got, expected)
                    deltas = [e["choices"][0]["delta"] for e in got[0] if e.get("choices")]
                    seen_reasoning |= any("reasoning_content" in d for d in deltas)
                else:
                    assert comparable(got) == comparable(expected), where
                    seen_reasoning |= "reasoning_content" in got["choices"][0]["message"]
    assert seen_reasoning, "the template produced no reasoning_content at all"


# -- tools: speculative until a tool call starts -------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_start_hands_the_request_to_the_server(
    http, ref_server, spec_server, reference_drafter, monkeypatch, stream
):
    """The test model never writes "<tool_call>", so the splice is exercised with a
    stand-in trigger: a word from the middle of the server's own answer. The server
    (whose real trigger never fires) answers unconstrained; the proxy must stop at the
    stand-in, let the server write the rest, and end up with the server's answer."""
    body = web_ui(MESSAGES, stream=stream, temperature=0)
    body = await bounded(http, ref_server, body, 24)
    expected, _ = await answer(http, ref_server, body)
    events = expected[0] if stream else None
    text = (
        "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
        if stream
        else expected["choices"][0]["message"]["content"]
    )
    stand_in = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stand_in) == 3 and text.find(stand_in) >= 3, text

    async def stand_in_triggers(self, probe):
        return [stand_in]

    monkeypatch.setattr(ToolTriggers, "_ask", stand_in_triggers)
    async with run_proxy(spec_server, reference_drafter, 3) as proxy:
        got, headers = await answer(proxy.session, proxy.url, body)
        assert proxy.state.metrics.requests["passthrough"] == (0 if stream else 1)
        # the engine stopped at the stand-in, before the answer's end
        assert 0 < proxy.state.metrics.generated_tokens < body["max_tokens"]
    if stream:
        assert headers["X-Npu-Spec"] == "speculative"
        got_events, done = got
        assert done and len({e["id"] for e in got_events}) == 1
        got_text = "".join(
            (e["choices"][0]["delta"].get("content") or "") for e in got_events if e["choices"]
        )
        assert got_text == text
        assert (
            got_events[-1]["choices"][0]["finish_reason"]
            == events[-1]["choices"][0]["finish_reason"]
        )
    else:
        assert headers["X-Npu-Spec"] == "passthrough"
        assert comparable(got) == comparable(expected)


async def test_tool_triggers_the_server_arms(spec_server, reference_drafter):
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        words = await proxy.state.tool_triggers.words(web_ui(MESSAGES))
    assert words == ["<tool_call>\n"]  # Qwen3's template, as the server reports it
