"""Fault suite: llama-server killed or unreachable mid-generation, stalled upstream,
drafter failures, clients that hang up at each point. Every case ends with the
proxy's slot groups, queue and draft sessions released, the server's /slots idle,
and a following valid request served correctly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.config import ProxySettings
from proxy.serve_cmd import serve
from proxy.server.llama_server import free_port
from proxy.server.upstream import Timeouts
from proxy.slot_share import SlotShare
from tests.proxy.helpers import assert_greedy_equal, post_json, tokenize
from tests.reliability.tools import (
    DrafterCounter,
    FaultRelay,
    hang_up,
    is_openai_error,
    proxy_for,
    record,
    server_idle,
    sse_events,
    wait_until,
)

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0, "return_tokens": True}
LONG = 600  # tokens: long enough that a fault always lands mid-generation


async def _read_stream(session: aiohttp.ClientSession, url: str, body: dict, first: asyncio.Event):
    """(status, raw body) of a streaming POST; `first` is set once data arrives."""
    async with session.post(url, json=body) as response:
        raw = b""
        try:
            async for chunk in response.content.iter_any():
                raw += chunk
                first.set()
        except aiohttp.ClientPayloadError:
            raw += b"\n<cut>"
        first.set()
        return response.status, raw


def _assert_interrupted(raw: bytes, kind: str) -> str:
    """The stream ended with an error event, and nothing in it claims completion."""
    events, done = sse_events(raw)
    assert events, raw[:300]
    assert not done, "an interrupted stream must not end with [DONE]"
    assert "error" in events[-1], f"last event is not an error: {events[-1]}"
    error = events[-1]["error"]
    assert error["code"] in (500, 502, 503) and error["message"], error
    for event in events[:-1]:
        if kind == "native":
            assert event.get("stop") is False, event
        else:
            assert all(c.get("finish_reason") is None for c in event.get("choices", [])), event
    return error["message"]


def _llama_server_pid(port: int) -> int:
    """The pid of the llama-server this test's proxy started on `port` (its own child)."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == me and b"--port" in cmdline and str(port).encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no child llama-server on port {port}")


async def test_managed_server_killed_mid_generation_is_restarted(
    request, http, ref_server, llama_server_bin, demo_models
):
    port, server_port = free_port(), free_port()
    settings = ProxySettings(
        target=demo_models / "target.gguf",
        llama_server=llama_server_bin,
        ctx=768,
        threads=1,
        conversations=3,
        server_port=server_port,
        drafter="ngram",
        k=2,
        port=port,
    )
    ready = asyncio.Event()
    task = asyncio.create_task(serve(settings, ready))
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(120):
            await ready.wait()
        streams = {
            "native": ("/completion", {"prompt": "Once", "n_predict": LONG, "stream": True}),
            "chat": (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": LONG,
                 "stream": True},
            ),
        }  # fmt: skip
        firsts = {name: asyncio.Event() for name in streams}
        tasks = {
            name: asyncio.create_task(
                _read_stream(http, url + path, {**body, "temperature": 0}, firsts[name])
            )
            for name, (path, body) in streams.items()
        }
        plain = asyncio.create_task(
            http.post(url + "/completion", json={"prompt": "Hi", "n_predict": LONG, **GREEDY})
        )
        async with asyncio.timeout(60):
            for event in firsts.values():
                await event.wait()
        os.kill(_llama_server_pid(server_port), signal.SIGKILL)
        async with asyncio.timeout(60):
            for name, stream_task in tasks.items():
                status, raw = await stream_task
                assert status == 200
                message = _assert_interrupted(raw, name)
                assert "127.0.0.1" in message  # names the upstream
            response = await plain
            payload = await response.json()
        assert response.status in (502, 503) and is_openai_error(payload, response.status)

        # the proxy stayed up; once the server is back a new request succeeds
        body = {"prompt": "Ab ab ab ab", "n_predict": 16, **GREEDY}

        async def served() -> bool:
            async with http.post(url + "/completion", json=body) as response:
                if response.status == 503:
                    assert "Retry-After" in response.headers
                return response.status == 200

        assert await wait_until(served, timeout=90, step=0.5)
        async with http.post(url + "/completion", json=body) as response:
            got = await response.json()
        expected = await post_json(http, ref_server + "/completion", body)
        prompt = await tokenize(http, ref_server, body["prompt"])
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        async with http.get(url + "/metrics") as response:
            page = await response.text()
        assert "npu_spec_server_restarts_total 1" in page
        assert "npu_spec_slot_groups_active 0" in page
        assert "npu_spec_drafter_sessions_open 0" in page
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    record(
        request.node.nodeid, "faults", "llama-server killed (SIGKILL) mid-generation, managed",
        3, "2 streams end with an error event naming the server (no [DONE]), the "
        "non-streaming request gets a JSON 502/503; the server is restarted and the next "
        "greedy request equals llama-server alone",
    )  # fmt: skip


async def test_unreachable_server_mid_generation_then_back(
    request, http, ref_server, spec_server, reference_drafter
):
    async with (
        FaultRelay(spec_server) as relay,
        proxy_for(relay.url, reference_drafter, k=2, retry_after_s=3) as proxy,
    ):
        first = asyncio.Event()
        body = {"prompt": "Once", "n_predict": LONG, "stream": True, "temperature": 0}
        stream = asyncio.create_task(_read_stream(http, proxy.url + "/completion", body, first))
        passthrough_first = asyncio.Event()
        pass_body = {**body, "n_probs": 1}  # n_probs: served by pass-through
        passed = asyncio.create_task(
            _read_stream(http, proxy.url + "/completion", pass_body, passthrough_first)
        )
        async with asyncio.timeout(60):
            await first.wait()
            await passthrough_first.wait()
        await relay.set_mode("down")
        async with asyncio.timeout(60):
            _status, raw = await stream
            _assert_interrupted(raw, "native")
            _status, raw = await passed
            _assert_interrupted(raw, "native")
        # while the server is away: 503 with Retry-After, in OpenAI format
        status, payload, headers = await proxy.post(
            "/completion", {"prompt": "x", "n_predict": 4, **GREEDY}
        )
        assert status == 503 and is_openai_error(payload, 503)
        assert headers["Retry-After"] == "3"
        await relay.set_mode("pass")
        body = {"prompt": "Back again", "n_predict": 16, **GREEDY}
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        expected = await post_json(http, ref_server + "/completion", body)
        prompt = await tokenize(http, ref_server, body["prompt"])
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        assert await wait_until(proxy.idle)
        assert await proxy.metric("npu_spec_upstream_failures_total") >= 2
    assert await wait_until(lambda: server_idle(spec_server))
    record(
        request.node.nodeid, "faults", "llama-server unreachable mid-generation, attached",
        3, "speculative and pass-through streams end with an error event; requests meanwhile "
        "get 503 + Retry-After; the first request after it returns succeeds, equal to "
        "llama-server alone",
    )  # fmt: skip


async def test_stalled_server_times_out_with_clear_errors(request, spec_server, reference_drafter):
    timeouts = Timeouts(connect=2.0, control=2.0, verify=2.0)
    async with (
        FaultRelay(spec_server) as relay,
        proxy_for(
            relay.url, reference_drafter, k=2, timeouts=timeouts, passthrough_read_timeout_s=2.0
        ) as proxy,
    ):
        cases = 0
        # 1. stalled before the first token, non-streaming: a JSON 503 within the bound
        await relay.set_mode("stall")
        started = time.monotonic()
        status, payload, _ = await proxy.post(
            "/completion", {"prompt": "Stall", "n_predict": 8, **GREEDY}
        )
        assert status == 503 and is_openai_error(payload, 503), payload
        assert "timed out" in payload["error"]["message"]
        assert time.monotonic() - started < 15
        cases += 1
        await relay.set_mode("pass")
        # 2. and 3. stalled mid-stream: speculative and pass-through end with an error event
        for extra in ({}, {"n_probs": 1}):
            first = asyncio.Event()
            body = {"prompt": "Once", "n_predict": LONG, "stream": True, "temperature": 0}
            reader = asyncio.create_task(
                _read_stream(proxy.session, proxy.url + "/completion", {**body, **extra}, first)
            )
            async with asyncio.timeout(60):
                await first.wait()
            await relay.set_mode("stall")
            started = time.monotonic()
            async with asyncio.timeout(30):
                _status, raw = await reader
            assert time.monotonic() - started < 15
            _assert_interrupted(raw, "native")
            await relay.set_mode("pass")
            cases += 1
        status, _, _ = await proxy.post("/completion", {"prompt": "Fine", "n_predict": 4, **GREEDY})
        assert status == 200
        assert await wait_until(proxy.idle)
    assert await wait_until(lambda: server_idle(spec_server))
    record(
        request.node.nodeid, "faults", "llama-server stalled (connection open, no bytes)",
        cases, "bounded by the configured timeouts (2 s here): JSON 503 'timed out' before "
        "the first token, an error event mid-stream (speculative and pass-through); the "
        "next request succeeds",
    )  # fmt: skip


@pytest.mark.parametrize("fault", ["raise", "hang", "garbage", "open"])
async def test_drafter_fault_continues_plainly_and_is_recreated(
    request, fault, http, ref_server, spec_server, reference_drafter
):
    drafter = DrafterCounter(reference_drafter, fault=None if fault == "open" else fault, at=1)
    if fault == "open":
        drafter.fail_open = 1
    body = {"prompt": "The drafter may fail", "n_predict": 24, **GREEDY}
    expected = await post_json(http, ref_server + "/completion", body)
    prompt = await tokenize(http, ref_server, body["prompt"])
    async with proxy_for(spec_server, drafter, k=2, draft_timeout_s=0.5) as proxy:
        for stream in (False, True):
            if stream:
                async with proxy.session.post(
                    proxy.url + "/completion", json={**body, "stream": True}
                ) as response:
                    events, _ = sse_events(await response.read())
                tokens = [t for e in events for t in e.get("tokens", []) if not e.get("stop")]
            else:
                status, got, _ = await proxy.post("/completion", body)
                assert status == 200, got
                tokens = got["tokens"]
            await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
        assert proxy.state.drafters is not None
        assert proxy.state.drafters.failures >= 1
        assert await proxy.metric("npu_spec_drafter_recreations_total") >= 1
        assert await proxy.metric("npu_spec_drafter_sessions_open") == 0
        if fault != "open":
            assert await proxy.metric("npu_spec_drafter_failures_total") >= 1
    record(
        request.node.nodeid, "faults", f"drafter fault: {fault}", 2,
        "request continues by plain decoding, output equals llama-server alone (stream and "
        "non-stream); fault counted, drafter re-created, no session left open",
    )  # fmt: skip


DISCONNECTS = {
    # point: (body extras, bytes to read before hanging up, seconds to wait first)
    "while queued": ({"stream": True}, 0, 0.5),
    "during prefill": ({"prompt": "word " * 500}, 0, 0.05),
    "during drafting": ({"stream": True}, 1, 0.1),
    "mid-stream": ({"stream": True}, 300, 0.0),
    "non-streaming generation": ({}, 0, 0.4),
    "pass-through stream": ({"stream": True, "n_probs": 1}, 300, 0.0),
}


async def test_client_disconnect_at_each_point_releases_everything(
    request, spec_server, reference_drafter
):
    slow = DrafterCounter(reference_drafter, delay_s=0.05)  # time spent inside drafting
    # k=2: three slots, one stream at a time, so a second request queues
    one_group = SlotShare(3, 3, max_streams=1)
    async with proxy_for(spec_server, slow, k=2, scheduler=one_group) as proxy:
        for point, (extra, after_bytes, wait_s) in DISCONNECTS.items():
            body = {"prompt": "Tell me", "n_predict": LONG, "temperature": 0, **extra}
            before = proxy.state.client_disconnects
            holder = None
            if point == "while queued":
                first = asyncio.Event()
                holder = asyncio.create_task(
                    _read_stream(proxy.session, proxy.url + "/completion", body, first)
                )
                async with asyncio.timeout(60):
                    await first.wait()
            await hang_up(proxy.url, "/completion", body, after_bytes, wait_s)
            if point == "while queued":
                assert await wait_until(lambda: proxy.state.scheduler.queued == 0)
                assert holder is not None
                holder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await holder
            assert await wait_until(proxy.idle), (point, proxy.state.drafters.snapshot())
            assert await wait_until(lambda: server_idle(spec_server)), point
            assert await wait_until(lambda b=before: proxy.state.client_disconnects > b), point
            assert proxy.state.metrics.generated_tokens < LONG * 3, point
            status, got, _ = await proxy.post(
                "/completion", {"prompt": "Next", "n_predict": 6, **GREEDY}
            )
            assert status == 200 and len(got["tokens"]) == 6, (point, got)
        page_open = await proxy.metric("npu_spec_drafter_sessions_open")
        assert page_open == 0
    record(
        request.node.nodeid, "faults", "client disconnect", len(DISCONNECTS),
        "at each point (" + "; ".join(DISCONNECTS) + "): slot group, queue place and draft "
        "session released (proxy /metrics), llama-server /slots idle, next request served",
    )  # fmt: skip
