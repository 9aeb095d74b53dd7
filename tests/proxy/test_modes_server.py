"""Managed and attached modes end to end, and the attach checks, against real servers."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.config import ProxySettings
from proxy.serve_cmd import serve
from proxy.server.attach_check import NothingListening, check_upstream
from proxy.server.llama_server import free_port
from tests.proxy.helpers import assert_greedy_equal, post_json, tokenize

pytestmark = [pytest.mark.server]


async def test_attach_check_accepts_the_managed_flags(spec_server):
    findings = await check_upstream(spec_server, k=2, conversations=4)
    assert [f for f in findings if f.severity == "error"] == []
    assert any("no re-prefill" in f.message for f in findings)


async def test_attach_check_names_the_flags_to_change(ref_server):
    findings = await check_upstream(ref_server, k=4, conversations=1)
    fixes = {f.fix for f in findings if f.severity == "error"}
    assert "-np 6" in fixes  # one slot cannot hold k+1 = 5 prompts
    assert "--metrics" in fixes


async def test_attach_check_suggests_slot_save_path(start_server, demo_models):
    server = await start_server(
        demo_models / "target.gguf",
        ["-np", "4", "--metrics", "-kvu", "--no-cache-idle-slots", "-cram", "0"],
        ctx=1024,
    )
    findings = await check_upstream(server.base_url, k=3)
    assert [f.severity for f in findings if f.severity == "error"] == []
    assert "--slot-save-path DIR" in {f.fix for f in findings if f.severity == "warning"}


async def test_attach_check_detects_idle_slot_wiping(start_server, demo_models):
    """Enough slots, metrics and unified KV, but the default idle-slot caching."""
    server = await start_server(
        demo_models / "target.gguf", ["-np", "5", "--metrics", "-kvu"], ctx=2560
    )
    findings = await check_upstream(server.base_url, k=4)
    errors = [f for f in findings if f.severity == "error"]
    assert len(errors) == 1 and "re-prefills" in errors[0].message, findings
    assert errors[0].fix == "--no-cache-idle-slots -cram 0"


async def test_attach_check_reports_an_unreachable_server():
    """Nothing listening is one line naming the URL, not a list of flags to fix."""
    with pytest.raises(NothingListening, match=r"nothing answers at http://127\.0\.0\.1:9"):
        await check_upstream("http://127.0.0.1:9", k=2)


async def _serve_in_background(settings: ProxySettings):
    ready = asyncio.Event()
    task = asyncio.create_task(serve(settings, ready))
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(ready.wait())], timeout=180, return_when="FIRST_COMPLETED"
    )
    if task in done:
        raise AssertionError(f"serve() ended early with {task.result()!r}")
    assert ready.is_set()
    return task


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(("mode", "drafter"), [("managed", "ngram"), ("attached", "folder")])
async def test_serve_end_to_end(
    mode, drafter, http, ref_server, spec_server, demo_models, llama_server_bin
):
    port = free_port()
    server_port = free_port()
    drafter = str(demo_models / "draft") if drafter == "folder" else drafter
    common = {"drafter": drafter, "k": 3, "port": port, "check_decodes": True}
    if mode == "managed":
        settings = ProxySettings(
            target=demo_models / "target.gguf",
            llama_server=llama_server_bin,
            ctx=768,
            threads=1,
            server_port=server_port,
            **common,
        )
    else:
        settings = ProxySettings(upstream=spec_server, **common)
    task = await _serve_in_background(settings)
    try:
        body = {"prompt": "Ab ab ab ab ab", "n_predict": 24, "temperature": 0, "return_tokens": 1}
        body["return_tokens"] = True
        expected = await post_json(http, ref_server + "/completion", body)
        async with http.post(f"http://127.0.0.1:{port}/completion", json=body) as response:
            assert response.headers["X-Npu-Spec"] == "speculative"
            got = await response.json()
        prompt = await tokenize(http, ref_server, body["prompt"])
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
            page = await response.text()
        assert "npu_spec_decode_check_failures_total 0" in page
    finally:
        await _stop(task)
    if mode == "managed":  # the proxy stopped the server it started
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"http://127.0.0.1:{server_port}/health"):
                pass


def test_a_drafter_for_another_tokenizer_is_refused(demo_models):
    from npu_draft.tokenizer_check import TokenizerMismatch, target_facts
    from proxy.serve_cmd import _drafter_opener

    settings = ProxySettings(upstream="http://x", drafter=str(demo_models / "draft"))
    other = target_facts("llama-3.gguf", 128256, 128000, [128009])
    with pytest.raises(TokenizerMismatch, match=r"llama-3\.gguf"):
        _drafter_opener(settings, other)
