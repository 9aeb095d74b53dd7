"""OpenAI-format error responses, shaped like llama-server's format_error_response."""

from __future__ import annotations

import json

from aiohttp import web

from proxy.server.upstream import UpstreamError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    502: "server_error",
    503: "unavailable_error",
    504: "unavailable_error",
}


def error_body(status: int, message: str, error_type: str | None = None) -> dict:
    return {
        "error": {
            "code": status,
            "message": message,
            "type": error_type or _TYPES.get(status, "server_error"),
        }
    }


def error_response(
    status: int, message: str, error_type: str | None = None, spec_header: str | None = None
) -> web.Response:
    headers = {"X-Npu-Spec": spec_header} if spec_header else None
    return web.Response(
        status=status,
        text=json.dumps(error_body(status, message, error_type)),
        content_type="application/json",
        headers=headers,
    )


def upstream_error_response(exc: UpstreamError, spec_header: str | None = None) -> web.Response:
    status = 503 if exc.status in (503, 504) else 502
    return error_response(status, str(exc), spec_header=spec_header)


def json_error_response(status: int, body: dict, spec_header: str | None = None) -> web.Response:
    """An error body from llama-server, passed on with its own status."""
    headers = {"X-Npu-Spec": spec_header} if spec_header else None
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )
