"""Forward a request to llama-server unchanged and stream its answer back byte for byte."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from proxy.api.errors import upstream_error_response
from proxy.upstream import UpstreamClient, UpstreamError

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


async def forward(
    request: web.Request, upstream: UpstreamClient, body: bytes | None = None
) -> web.StreamResponse:
    """Pass `request` (with its already-read `body`, if any) to the upstream server."""
    if body is None:
        body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
    url = upstream.base_url + request.rel_url.raw_path_qs
    try:
        upstream_response = await upstream.session.request(
            request.method,
            url,
            headers=headers,
            data=body if body else None,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=upstream.timeouts.connect, sock_read=None
            ),
            allow_redirects=False,
        )
    except TimeoutError:
        return upstream_error_response(
            UpstreamError(upstream.base_url, f"{request.method} {request.path} timed out", 504),
            spec_header="passthrough",
        )
    except aiohttp.ClientConnectorError as exc:
        return upstream_error_response(
            UpstreamError(upstream.base_url, f"cannot connect ({exc.os_error})", 503),
            spec_header="passthrough",
        )
    except aiohttp.ClientError as exc:
        return upstream_error_response(
            UpstreamError(upstream.base_url, f"{request.method} {request.path}: {exc!r}", 502),
            spec_header="passthrough",
        )
    async with upstream_response:
        response = web.StreamResponse(
            status=upstream_response.status, reason=upstream_response.reason
        )
        for key, value in upstream_response.headers.items():
            if key.lower() not in _DROP_RESPONSE:
                response.headers.add(key, value)
        response.headers[HEADER] = "passthrough"
        length = upstream_response.headers.get("Content-Length")
        if length is not None:
            response.content_length = int(length)
        await response.prepare(request)
        # A client that goes away cancels this handler; leaving the `async with`
        # closes the upstream connection, which makes llama-server drop the task.
        async for chunk in upstream_response.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
