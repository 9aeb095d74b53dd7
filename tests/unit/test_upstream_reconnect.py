"""A keep-alive connection llama-server dropped is sent again once, not turned into a 502."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.server.upstream import UpstreamClient, UpstreamError

REPLY = json.dumps({"tokens": [7, 8]}).encode()


async def _server(drops: int) -> tuple[asyncio.Server, list[str]]:
    """Answers /tokenize after closing its first `drops` connections unanswered, as
    cpp-httplib does with a connection that sat idle past its keep-alive timeout."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length")), 0,
        )  # fmt: skip
        await reader.readexactly(length)
        seen.append(head.split(b" ")[1].decode())
        if len(seen) <= drops:
            writer.close()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(REPLY)}\r\n\r\n".encode()
            + REPLY
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.parametrize("drops, answered", [(0, True), (1, True), (2, False)])
async def test_a_dropped_connection_is_sent_again_once(drops: int, answered: bool) -> None:
    server, seen = await _server(drops)
    port = server.sockets[0].getsockname()[1]
    async with server, UpstreamClient(f"http://127.0.0.1:{port}") as upstream:
        if answered:
            assert await upstream.tokenize("hi") == [7, 8]
        else:
            with pytest.raises(UpstreamError, match="Server disconnected") as failure:
                await upstream.tokenize("hi")
            assert failure.value.status == 502
    assert seen == ["/tokenize"] * min(drops + 1, 2)


@pytest.mark.parametrize("drops, status", [(1, 200), (2, 502)])
async def test_a_passed_through_request_on_a_dropped_connection_is_sent_again_once(
    drops: int, status: int
) -> None:
    """Pass-through too: while plain decoding is the measured choice most requests take
    it, and a pooled connection the server dropped must not become a 502."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from proxy.api.passthrough import forward

    server, seen = await _server(drops)
    port = server.sockets[0].getsockname()[1]
    async with server, UpstreamClient(f"http://127.0.0.1:{port}") as upstream:

        async def handler(request: web.Request) -> web.StreamResponse:
            return await forward(request, upstream)

        app = web.Application()
        app.router.add_post("/tokenize", handler)
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/tokenize", json={"content": "hi"})
            assert response.status == status
            if status == 200:
                assert await response.read() == REPLY
                assert response.headers["X-Npu-Spec"] == "passthrough"
    assert seen == ["/tokenize"] * 2
