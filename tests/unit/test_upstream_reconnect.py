"""A request llama-server never answered (the connection it went out on was closed or
reset first) is sent again once, on a new connection, not turned into a 502; and a
pass-through stream's connection, which llama-server closes after the answer, is
never pooled for the next request."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.guard import JSON_BODY
from proxy.api.passthrough import forward
from proxy.server.upstream import UpstreamClient, UpstreamError, unanswered

REPLY = json.dumps({"tokens": [7, 8]}).encode()


def _drop(writer: asyncio.StreamWriter, how: str) -> None:
    """Close a connection unanswered: "close" sends FIN (cpp-httplib closing a
    connection it is done with), "reset" sends RST (a close with unread data, or a
    request that arrived after the close)."""
    if how == "reset":
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]] | None:
    """(path, headers with lower-case names) of the next request, None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode().split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0].split(" ")[1], headers


async def _server(drops: int, how: str = "close") -> tuple[asyncio.Server, list[str]]:
    """Answers /tokenize after dropping its first `drops` connections unanswered, as
    cpp-httplib does with a connection that sat idle past its keep-alive timeout."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        assert request is not None
        seen.append(request[0])
        if len(seen) <= drops:
            _drop(writer, how)
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(REPLY)}\r\n\r\n".encode()
            + REPLY
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


def _passthrough_app(upstream: UpstreamClient) -> web.Application:
    """`forward` behind a stand-in for the guard, which hands routes the parsed body."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        request[JSON_BODY] = json.loads(body) if body else None
        return await forward(request, upstream, body)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return app


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("drops, answered", [(0, True), (1, True), (2, False)])
async def test_a_dropped_connection_is_sent_again_once(
    drops: int, answered: bool, how: str
) -> None:
    server, seen = await _server(drops, how)
    port = server.sockets[0].getsockname()[1]
    async with server, UpstreamClient(f"http://127.0.0.1:{port}") as upstream:
        if answered:
            assert await upstream.tokenize("hi") == [7, 8]
        else:
            with pytest.raises(UpstreamError) as failure:
                await upstream.tokenize("hi")
            assert failure.value.status == 502
            assert f"127.0.0.1:{port}" in str(failure.value)
            why = "Server disconnected" if how == "close" else "Connection reset"
            assert why in str(failure.value)
    assert seen == ["/tokenize"] * min(drops + 1, 2)


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("drops, status", [(1, 200), (2, 502)])
async def test_a_passed_through_request_on_a_dropped_connection_is_sent_again_once(
    drops: int, status: int, how: str
) -> None:
    """Pass-through too: while plain decoding is the measured choice most requests take
    it, and a pooled connection the server dropped must not become a 502."""
    server, seen = await _server(drops, how)
    port = server.sockets[0].getsockname()[1]
    upstream = UpstreamClient(f"http://127.0.0.1:{port}")
    async with server, upstream, TestClient(TestServer(_passthrough_app(upstream))) as client:
        response = await client.post("/tokenize", json={"content": "hi"})
        assert response.status == status
        assert response.headers["X-Npu-Spec"] == "passthrough"
        if status == 200:
            assert await response.read() == REPLY
        else:  # which upstream, and why
            message = (await response.json())["error"]["message"]
            assert f"upstream llama-server at http://127.0.0.1:{port}" in message
            assert "POST /tokenize" in message
    assert seen == ["/tokenize"] * 2


@pytest.mark.parametrize(
    "exc, expected",
    [
        # the CI load test's 502: the server's close came between head and body
        (aiohttp.ClientOSError(None, "Can not write request body for http://h/completion"), True),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), True),
        # the server is not there: a refused connection is a 503, not sent again
        (aiohttp.ClientConnectorError(None, ConnectionRefusedError(111, "refused")), False),  # type: ignore[arg-type]
        (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), False),
        (aiohttp.ClientPayloadError("Response payload is not completed"), False),
        (TimeoutError(), False),
    ],
)
def test_which_failures_count_as_unanswered(exc: BaseException, expected: bool) -> None:
    assert unanswered(exc) is expected


class _KeepAliveServer:
    """A keep-alive HTTP/1.1 server that numbers its connections and records, for
    each request, (connection number, path, its Connection header). /stream is
    answered chunked, anything else with a Content-Length; "Connection: close" is
    honoured as cpp-httplib honours it. With `reset_old` set, a request that comes on
    a connection numbered up to it is reset (a stale pooled connection)."""

    def __init__(self, hold_until: int = 0) -> None:
        self.requests: list[tuple[int, str, str]] = []
        self.connections = 0
        self.reset_old: int | None = None  # connections numbered up to this one
        self._hold_until = hold_until  # answer nothing until this many requests wait
        self._waiting = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        while (request := await _read_request(reader)) is not None:
            path, headers = request
            self.requests.append((number, path, headers.get("connection", "")))
            if self.reset_old is not None and number <= self.reset_old:
                _drop(writer, "reset")
                return
            if len(self.requests) >= self._hold_until:
                self._waiting.set()
            await self._waiting.wait()
            close = headers.get("connection", "").lower() == "close"
            head = "HTTP/1.1 200 OK\r\n" + ("Connection: close\r\n" if close else "")
            if path == "/stream":
                event = b'data: {"content": "x"}\n\n'
                writer.write(
                    f"{head}Content-Type: text/event-stream\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n".encode()
                    + f"{len(event):x}\r\n".encode() + event + b"\r\n0\r\n\r\n"
                )  # fmt: skip
            else:
                writer.write(
                    f"{head}Content-Type: application/json\r\n"
                    f"Content-Length: {len(REPLY)}\r\n\r\n".encode() + REPLY
                )  # fmt: skip
            await writer.drain()
            if close:
                break
        writer.close()


async def _started(server: _KeepAliveServer) -> tuple[asyncio.Server, str]:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    return listening, f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"


async def test_the_retry_takes_a_new_connection_not_another_pooled_one() -> None:
    """Two idle pooled connections, both dropped by the server: the retry of the
    request that met the first must not take the second."""
    fake = _KeepAliveServer(hold_until=2)  # two requests at once: two connections
    listening, url = await _started(fake)
    async with listening, UpstreamClient(url) as upstream:
        assert await asyncio.gather(upstream.tokenize("a"), upstream.tokenize("b")) == [
            [7, 8],
            [7, 8],
        ]
        assert fake.connections == 2
        fake.reset_old = 2
        assert await upstream.tokenize("c") == [7, 8]
    # the first went out on a pooled connection and was reset, the second on a new one
    first, second = (number for number, _, _ in fake.requests[2:])
    assert first in (1, 2) and second == 3


async def test_a_streamed_pass_through_does_not_leave_its_connection_in_the_pool() -> None:
    """llama-server closes the connection after each streamed answer while saying
    keep-alive; a pooled copy failed the next request sent on it (the CI load test's
    502 "Can not write request body"). The stream asks the server to close instead,
    so the next request takes a new connection. Two non-streamed requests share one
    connection: the test sees reuse where there is some."""
    fake = _KeepAliveServer()
    listening, url = await _started(fake)
    upstream = UpstreamClient(url)
    async with listening, upstream, TestClient(TestServer(_passthrough_app(upstream))) as client:
        for path, body in (
            ("/tokenize", {"content": "a"}),
            ("/tokenize", {"content": "b"}),
            ("/stream", {"prompt": "c", "stream": True}),
            ("/tokenize", {"content": "d"}),
        ):
            response = await client.post(path, json=body)
            assert response.status == 200, await response.text()
            await response.read()
    assert fake.requests == [
        (1, "/tokenize", ""),
        (1, "/tokenize", ""),
        (1, "/stream", "close"),
        (2, "/tokenize", ""),
    ]
