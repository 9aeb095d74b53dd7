"""`doctor --upstream` and attached `serve` tell a proxy from llama-server, and read
`-kvu` from the command line of a llama-server on this machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import aiohttp
import pytest

from proxy import doctor, serve_cmd
from proxy.config import ProxySettings
from proxy.serve_cmd import serve
from proxy.server.attach_check import check_upstream
from proxy.server.llama_server import free_port
from tests.proxy.conftest import run_proxy

pytestmark = [pytest.mark.server]


def _doctor_upstream(url: str, k: int = 2) -> tuple[int, str]:
    args = argparse.Namespace(llama_server=None, upstream=url, k=k, conversations=1)
    lines: list[str] = []
    code = doctor.run(args, echo=lines.append)
    return code, "\n".join(lines)


async def test_doctor_pointed_at_the_proxy_says_so(spec_server) -> None:
    async with run_proxy(spec_server, None, k=2) as proxy:
        code, text = await asyncio.to_thread(_doctor_upstream, proxy.url)
    assert code == 1
    assert "is an npu-spec proxy" in text and "not llama-server" in text
    assert "healthy" not in text


async def test_serve_refuses_to_attach_to_a_proxy(spec_server) -> None:
    async with run_proxy(spec_server, None, k=2) as proxy:
        code = await serve(ProxySettings(upstream=proxy.url, port=0))
    assert code == 1


async def test_the_managed_flags_read_as_unified_kv(spec_server) -> None:
    findings = await check_upstream(spec_server, k=2, conversations=4)
    assert [f for f in findings if f.severity == "warning" and "-kvu" in (f.fix or "")] == []
    assert any("unified KV cache on" in f.message for f in findings)


async def test_a_server_without_unified_kv_is_named(start_server, demo_models) -> None:
    server = await start_server(
        demo_models / "target.gguf",
        ["-np", "4", "--metrics", "--no-cache-idle-slots", "-cram", "0"],
        ctx=1024,
    )
    findings = await check_upstream(server.base_url, k=3)
    unified = [f for f in findings if f.fix == "-kvu"]
    assert len(unified) == 1 and "without a unified KV cache" in unified[0].message, findings


async def test_server_arg_gives_a_flag_its_value(demo_models, llama_server_bin) -> None:
    """`--server-arg "--alias 'quick start'"` reaches the managed llama-server as two
    arguments: the server then names its model that way."""
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    port = free_port()
    args = parser.parse_args(
        ["--target", str(demo_models / "target.gguf"), "--llama-server", str(llama_server_bin),
         "-k", "1", "--ctx", "256", "--threads", "1", "--port", str(port),
         "--server-arg", "--alias 'quick start'", "--server-arg=--no-warmup"]
    )  # fmt: skip
    ready = asyncio.Event()
    task = asyncio.create_task(serve(serve_cmd.settings_from_args(args), ready))
    try:
        await asyncio.wait_for(ready.wait(), 180)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/v1/models") as response,
        ):
            models = await response.json()
        assert [m["id"] for m in models["data"]] == ["quick start"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
