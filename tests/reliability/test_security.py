"""Security: loopback by default, API key (constant-time check, forwarded or
replaced upstream), body size limit, slot actions, generated slot file names, and
no key in logs, reprs or command lines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from pathlib import Path

import aiohttp
import pytest

from proxy.api.guard import GuardSettings
from proxy.config import ProxySettings
from proxy.serve_cmd import serve
from proxy.server.llama_server import free_port
from proxy.server.managed import ServerLayout, verification_flags
from tests.reliability.tools import is_openai_error, proxy_for, record

KEY = "proxy-key-Zx81"
UPSTREAM_KEY = "server-key-Qe27"
GREEDY = {"prompt": "Key", "n_predict": 4, "temperature": 0, "return_tokens": True}


def test_defaults_bind_to_loopback_and_hide_keys():
    settings = ProxySettings(upstream="http://127.0.0.1:1", api_key=KEY, upstream_api_key="u")
    assert settings.host == "127.0.0.1" and settings.server_host == "127.0.0.1"
    assert KEY not in repr(settings) and "'u'" not in repr(settings)
    assert KEY not in repr(GuardSettings(api_key=KEY))
    assert settings.allow_slot_actions and settings.max_queue > 0


@pytest.fixture
async def keyed_server(start_server, demo_models, tmp_path):
    """A llama-server that itself requires UPSTREAM_KEY (from a file, as managed mode
    passes it)."""
    key_file = tmp_path / "key"
    key_file.write_text(UPSTREAM_KEY + "\n")
    layout = ServerLayout(k=2, ctx_per_conversation=512, conversations=1, passthrough_slots=1)
    flags = verification_flags(layout, tmp_path / "slots")
    (tmp_path / "slots").mkdir()
    server = await start_server(
        demo_models / "target.gguf", [*flags, "--api-key-file", str(key_file)]
    )
    return server.base_url


@pytest.mark.server
async def test_api_key_required_and_replaced_upstream(request, keyed_server, reference_drafter):
    cases = 0
    async with proxy_for(
        keyed_server, reference_drafter, k=2, api_key=KEY, upstream_api_key=UPSTREAM_KEY,
        replace_upstream_auth=True,
    ) as proxy:  # fmt: skip
        refused = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY + "x"},
            {"X-Api-Key": "nope"},
            {"Authorization": f"Bearer {UPSTREAM_KEY}"},
        ]
        for headers in refused:
            for path in ("/completion", "/v1/models", "/metrics", "/slots"):
                async with proxy.session.request(
                    "GET" if path != "/completion" else "POST", proxy.url + path,
                    json=GREEDY if path == "/completion" else None, headers=headers,
                ) as response:  # fmt: skip
                    payload = await response.json(content_type=None)
                    assert response.status == 401, (headers, path)
                    assert is_openai_error(payload, 401)
                    assert payload["error"]["type"] == "authentication_error"
                    cases += 1
        async with proxy.session.get(proxy.url + "/health") as response:
            assert response.status == 200  # public, as on llama-server
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}):
            status, got, response_headers = await proxy.post("/completion", GREEDY, headers=headers)
            assert status == 200 and response_headers["X-Npu-Spec"] == "speculative", got
            # pass-through: the client's key is replaced by the server's
            async with proxy.session.get(proxy.url + "/v1/models", headers=headers) as response:
                assert response.status == 200
            cases += 2
    record(
        request.node.nodeid, "security", "API key (replace mode)", cases,
        "missing, wrong, prefixed or the upstream's own key: 401 in OpenAI format on "
        "speculative, pass-through and /metrics routes; /health public; the right key "
        "(Bearer or X-Api-Key) is served, with the upstream key put in its place",
    )  # fmt: skip


@pytest.mark.server
async def test_api_key_forwarded(start_server, demo_models, tmp_path, reference_drafter):
    """Forward mode: llama-server and proxy share one key; the client's header goes on."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    layout = ServerLayout(k=2, ctx_per_conversation=512, conversations=1, passthrough_slots=1)
    (tmp_path / "slots").mkdir()
    flags = [*verification_flags(layout, tmp_path / "slots"), "--api-key-file", str(key_file)]
    server = await start_server(demo_models / "target.gguf", flags)
    async with proxy_for(
        server.base_url, reference_drafter, k=2, api_key=KEY, upstream_api_key=KEY
    ) as proxy:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with proxy.session.get(proxy.url + "/v1/models", headers=headers) as response:
            assert response.status == 200
        status, _, _ = await proxy.post("/completion", GREEDY, headers=headers)
        assert status == 200


@pytest.mark.server
async def test_managed_mode_locks_the_server_and_logs_no_key(
    request, caplog, llama_server_bin, demo_models
):
    port, server_port = free_port(), free_port()
    settings = ProxySettings(
        target=demo_models / "target.gguf", llama_server=llama_server_bin, ctx=512, threads=1,
        server_port=server_port, drafter="ngram", k=2, port=port, api_key=KEY,
    )  # fmt: skip
    caplog.set_level(logging.DEBUG)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(settings, ready))
    try:
        async with asyncio.timeout(120):
            await ready.wait()
        cmdlines = [
            p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()
        ]  # the server's command line names a key FILE, never a key
        ours = [c for c in cmdlines if f"{server_port}".encode() in c and b"--port" in c]
        assert ours and all(b"--api-key-file" in c and KEY.encode() not in c for c in ours)
        key_file = Path(ours[0].split(b"\0")[ours[0].split(b"\0").index(b"--api-key-file") + 1]
                        .decode())  # fmt: skip
        generated = key_file.read_text().strip()
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        async with aiohttp.ClientSession() as http:
            # nobody reaches the managed llama-server around the proxy
            async with http.get(f"http://127.0.0.1:{server_port}/v1/models") as response:
                assert response.status == 401
            async with http.post(
                f"http://127.0.0.1:{port}/completion", json=GREEDY,
                headers={"Authorization": f"Bearer {KEY}"},
            ) as response:  # fmt: skip
                assert response.status == 200
            async with http.post(f"http://127.0.0.1:{port}/completion", json=GREEDY) as response:
                assert response.status == 401
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    logs = caplog.text
    assert KEY not in logs and generated not in logs
    assert not key_file.exists()  # removed with the proxy
    record(
        request.node.nodeid, "security", "managed mode with an API key", 4,
        "llama-server gets a random key via a 0600 --api-key-file (not on its command line) "
        "and answers 401 to anyone but the proxy; neither key appears in the logs; the key "
        "file is deleted on exit",
    )  # fmt: skip


@pytest.mark.server
async def test_body_limit_is_413_in_openai_format(request, spec_server, reference_drafter):
    limit = 64 * 1024
    async with proxy_for(spec_server, reference_drafter, k=2, max_body_bytes=limit) as proxy:
        big = {"prompt": "x" * (limit + 10), "n_predict": 2}
        status, payload, _ = await proxy.post("/completion", big)  # with Content-Length
        assert status == 413 and is_openai_error(payload, 413)

        async def chunks():  # no Content-Length: cut off while reading
            for _ in range(4):
                yield b"x" * (limit // 2)

        for path in ("/completion", "/tokenize", "/v1/audio/transcriptions"):
            async with proxy.session.post(
                proxy.url + path, data=chunks(), headers={"Content-Type": "application/json"}
            ) as response:
                payload = await response.json(content_type=None)
                assert response.status == 413 and is_openai_error(payload, 413), payload
        status, _, _ = await proxy.post("/completion", GREEDY)
        assert status == 200
    record(
        request.node.nodeid, "security", "request body over the size limit", 4,
        "413 in OpenAI format, with or without Content-Length, on speculative and "
        "pass-through routes; the next request is served",
    )  # fmt: skip


@pytest.mark.server
async def test_slot_actions(request, spec_server, reference_drafter):
    async with proxy_for(spec_server, reference_drafter, k=2, allow_slot_actions=False) as proxy:
        status, payload, _ = await proxy.post("/slots/0?action=save", {"filename": "a.bin"})
        assert status == 403 and is_openai_error(payload, 403)
        async with proxy.session.get(proxy.url + "/slots") as response:
            assert response.status == 200  # monitoring stays available
        stem = proxy.state.slot_file_stem
    async with proxy_for(spec_server, reference_drafter, k=2) as proxy:
        assert re.fullmatch(r"npu-spec-[0-9a-f]{16}", proxy.state.slot_file_stem)
        assert proxy.state.slot_file_stem != stem  # generated per proxy, unguessable
        for name in (f"{proxy.state.slot_file_stem}-g0.bin", "npu-spec-anything"):
            for action in ("save", "restore", "erase"):
                status, payload, _ = await proxy.post(
                    f"/slots/0?action={action}", {"filename": name}
                )
                assert status == 403 and is_openai_error(payload, 403), payload
        status, payload, _ = await proxy.post("/slots/0?action=save", {"filename": "mine.bin"})
        assert status == 200, payload
    record(
        request.node.nodeid, "security", "slot actions", 8,
        "--no-slot-actions: 403 for save/restore/erase while GET /slots still works; "
        "otherwise clients may use their own file names but never the proxy's (random "
        "per process, npu-spec- prefix reserved): 403",
    )  # fmt: skip
