"""Forward a request to llama-server unchanged and stream its answer back byte for byte."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from proxy.api.errors import upstream_error_response
from proxy.api.guard import parsed_body
from proxy.server.upstream import UpstreamClient, UpstreamError

# Hop-by-hop headers (RFC 9110 §7.6.1) and those aiohttp sets itself.
_DROP_REQUEST = {
    "host", "connection", "keep-alive", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length",
}  # fmt: skip
_DROP_RESPONSE = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "content-length", "date",
}  # fmt: skip

HEADER = "X-Npu-Spec"
# With an upstream key configured these never leave the proxy: the session's own
# Authorization header (the upstream key) takes their place.
_CLIENT_AUTH = {"authorization", "x-api-key"}

log = logging.getLogger(__name__)


class UpstreamBroke(ConnectionResetError):
    """llama-server's answer stopped half-way: the client connection is dropped
    rather than ended cleanly, so a cut body never looks complete."""


async def forward(
    request: web.Request,
    upstream: UpstreamClient,
    body: bytes | None = None,
    replace_auth: bool = False,
    read_timeout_s: float | None = None,
    on_first_chunk: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Pass `request` (with its already-read `body`, if any) to the upstream server.

    `read_timeout_s` bounds each silence of the server (not the whole answer: a long
    generation is fine, a stalled server is not). `on_first_chunk` is called once the
    first bytes of the answer's body are relayed.
    """
    if body is None:
        body = await request.read()
    drop = _DROP_REQUEST | _CLIENT_AUTH if replace_auth else _DROP_REQUEST
    headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    if _asks_for_stream(request):
        # llama-server closes the connection after every streamed answer although it
        # says keep-alive (its chunked content provider ends with `false`, which
        # cpp-httplib takes for a cancel): a pooled copy of it would fail the next
        # request sent on it. Asked to close, the server says so and none is pooled.
        headers["Connection"] = "close"
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=upstream.timeouts.connect, sock_read=read_timeout_s
    )
    try:
        # sent again once, on a new connection, where the server answered nothing
        upstream_response = await upstream.request(
            request.method, request.rel_url.raw_path_qs, headers=headers,
            data=body if body else None, timeout=timeout, allow_redirects=False,
        )  # fmt: skip
    except (TimeoutError, aiohttp.ClientError) as exc:
        return _unreachable(request, upstream, exc)
    async with upstream_response:
        response = _mirrored_head(upstream_response)
        await response.prepare(request)
        # A client that goes away cancels this handler; leaving the `async with`
        # closes the upstream connection, which makes llama-server drop the task.
        await _relay_body(request, upstream_response, response, on_first_chunk)
        await response.write_eof()
        return response


def _asks_for_stream(request: web.Request) -> bool:
    body = parsed_body(request)
    return isinstance(body, dict) and bool(body.get("stream"))


def _unreachable(
    request: web.Request, upstream: UpstreamClient, exc: TimeoutError | aiohttp.ClientError
) -> web.Response:
    """The error answer for a request the server never answered."""
    if isinstance(exc, TimeoutError):
        error = UpstreamError(upstream.base_url, f"{request.method} {request.path} timed out", 504)
    elif isinstance(exc, aiohttp.ClientConnectorError):
        error = UpstreamError(upstream.base_url, f"cannot connect ({exc.os_error})", 503)
    else:
        error = UpstreamError(upstream.base_url, f"{request.method} {request.path}: {exc!r}", 502)
    return upstream_error_response(error, spec_header="passthrough")


def _mirrored_head(upstream_response: aiohttp.ClientResponse) -> web.StreamResponse:
    """The server's status and end-to-end headers, marked as passed through."""
    response = web.StreamResponse(status=upstream_response.status, reason=upstream_response.reason)
    for key, value in upstream_response.headers.items():
        if key.lower() not in _DROP_RESPONSE:
            response.headers.add(key, value)
    response.headers[HEADER] = "passthrough"
    length = upstream_response.headers.get("Content-Length")
    if length is not None:
        response.content_length = int(length)
    return response


async def _relay_body(
    request: web.Request,
    upstream_response: aiohttp.ClientResponse,
    response: web.StreamResponse,
    on_first_chunk: Callable[[], None] | None = None,
) -> None:
    """Copy the server's body as it comes. A body cut off by the server ends an SSE
    stream with an error event and drops any other client connection."""
    try:
        async for chunk in upstream_response.content.iter_any():
            await response.write(chunk)
            if on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
    except (aiohttp.ClientError, TimeoutError) as exc:
        stalled = isinstance(exc, TimeoutError)
        # the message names the server, as the speculative path's errors do
        reason = f"at {upstream_response.url.origin()} " + (
            "stalled" if stalled else f"broke off ({exc!r})"
        )
        log.warning("pass-through %s %s: llama-server %s", request.method, request.path, reason)
        if upstream_response.content_type == "text/event-stream":
            # an SSE client gets the server's own way of ending a failed stream
            error = {"code": 502, "message": f"upstream llama-server {reason}",
                     "type": "server_error"}  # fmt: skip
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
        else:
            raise UpstreamBroke(f"upstream answer to {request.path} cut off") from exc
