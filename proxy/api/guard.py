"""Request guards that run before any route: errors in OpenAI format, API key,
body size and JSON sanity, slot actions.

Every refusal here is a 4xx with llama-server's error shape
(`{"error": {"code", "message", "type"}}`), so clients handle the proxy's errors
exactly as the server's.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.api.errors import error_response

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# llama-server's own public endpoints (server-http.cpp get_public_endpoints).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
# Slot files the proxy writes start with this; clients may not name them.
RESERVED_SLOT_PREFIX = "npu-spec-"
# The parsed JSON body (a body that does not parse never reaches a route).
JSON_BODY: web.RequestKey[Any] = web.RequestKey("npu_spec_json_body", object)
_SLOT_ACTION = re.compile(r"^/slots/[^/]*$")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SPEC_HEADER = "X-Npu-Spec"
OWN_ANSWER = "proxy"  # the X-Npu-Spec value of answers neither path served


@dataclass(frozen=True)
class GuardSettings:
    api_key: str | None = field(default=None, repr=False)  # never in a repr or a log
    max_body_bytes: int = 16 * 1024 * 1024
    allow_slot_actions: bool = True
    n_vocab: int | None = None  # token ids must be below this (None: unchecked)


def parsed_body(request: web.Request) -> Any:
    """The JSON body the guard parsed: None when there was none."""
    return request.get(JSON_BODY)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (413 from a too-large body, 404, 405, ...) and anything
    unexpected become OpenAI-format JSON; nothing escapes as an HTML page. Answers the
    proxy gives itself (these, and the refusals below) carry `X-Npu-Spec: proxy`."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return error_response(
                413, "request body too large", "invalid_request_error", spec_header=OWN_ANSWER
            )
        return error_response(exc.status, exc.reason or "error", spec_header=OWN_ANSWER)
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(
            500, "internal error in npu-spec (see the proxy's log)", spec_header=OWN_ANSWER
        )
    if not response.prepared and SPEC_HEADER not in response.headers:
        response.headers[SPEC_HEADER] = OWN_ANSWER
    return response


def _presented_key(request: web.Request) -> str:
    value = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
    return value[len("Bearer ") :] if value.startswith("Bearer ") else value


def keys_match(given: str, expected: str) -> bool:
    # compare_digest: time does not depend on where the strings first differ.
    # Header values carry undecodable bytes as surrogate escapes: compare the bytes.
    try:
        presented = given.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        presented = b""  # cannot match a configured key; still compared below
    return hmac.compare_digest(presented, expected.encode("utf-8")) and bool(expected)


def auth_middleware(settings: GuardSettings) -> Callable:
    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            settings.api_key
            and request.path not in PUBLIC_PATHS
            and not keys_match(_presented_key(request), settings.api_key)
        ):
            # the key itself is never logged
            log.warning("unauthorized %s %s from %s", request.method, request.path,
                        request.remote)  # fmt: skip
            return error_response(401, "Invalid API Key", "authentication_error")
        return await handler(request)

    return check_key


def _invalid_token(value: Any, n_vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < n_vocab


def out_of_vocab(path: str, body: Any, n_vocab: int | None) -> str | None:
    """A message when a token-id field holds an id the model does not have.

    llama-server answers 500 (a vector range check) for such ids on /detokenize and
    /tokenize; its completion routes already answer 400, which the proxy mirrors.
    """
    if n_vocab is None or not isinstance(body, dict):
        return None
    if path in GENERATION_PATHS:
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) else []
        for item in [prompts, *(p for p in prompts if isinstance(p, list))]:
            if any(_invalid_token(t, n_vocab) for t in item):
                return "Prompt contains invalid tokens"  # the server's own answer
    if path == "/detokenize":
        tokens = body.get("tokens")
        if isinstance(tokens, list) and any(_invalid_token(t, n_vocab) for t in tokens):
            return f"token ids must be between 0 and {n_vocab - 1}"
    if path == "/tokenize":
        content = body.get("content")
        if isinstance(content, list) and any(_invalid_token(t, n_vocab) for t in content):
            return f"token ids must be between 0 and {n_vocab - 1}"
    return None


# OpenAI's message roles. llama-server renders any role string through the chat
# template (most templates silently drop unknown ones); the proxy refuses them, as
# OpenAI does, so a typo or a forged role never becomes a silently different prompt.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/apply-template"})


def bad_role(path: str, body: Any) -> str | None:
    if path not in CHAT_PATHS or not isinstance(body, dict):
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None  # the server answers a malformed list itself (400)
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else "user"
        if not isinstance(role, str) or role not in CHAT_ROLES:  # lists are unhashable
            shown = repr(role)[:40] if role is not None else "no role"
            return f"messages[{index}]: invalid role {shown}; expected one of {sorted(CHAT_ROLES)}"
    return None


# Token limits: llama-server reads them as int32 and refuses anything outside
# -1..INT32_MAX with 400; the proxy must refuse the same values before its own
# engine takes an absurd limit for "until the context is full".
LIMIT_KEYS = ("n_predict", "max_tokens", "max_completion_tokens")
GENERATION_PATHS = frozenset(
    {"/completion", "/completions", "/v1/completions", "/v1/chat/completions", "/chat/completions",
     "/infill"}
)  # fmt: skip
_INT32_MAX = 2**31 - 1


def bad_limit(path: str, body: Any) -> str | None:
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return None
    for key in LIMIT_KEYS:
        value = body.get(key)
        if isinstance(value, bool):  # the server would read true as 1
            return f"Field '{key}': type must be number, but is boolean"
        if isinstance(value, float) and not value.is_integer():  # the server truncates
            return f"Field '{key}': must be a whole number, but got {value}"
        if isinstance(value, int) and not isinstance(value, bool) and not -1 <= value <= _INT32_MAX:
            # the server's own wording (server-schema.cpp)
            return (
                f"Field '{key}': Value must be between -1 <= value <= {_INT32_MAX}, but got {value}"
            )
    return None


def body_middleware(settings: GuardSettings) -> Callable:
    @web.middleware
    async def check_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in _BODY_METHODS:
            return await handler(request)
        length = request.content_length
        if length is not None and length > settings.max_body_bytes:
            return error_response(
                413,
                f"request body of {length} bytes exceeds the limit of "
                f"{settings.max_body_bytes} bytes",
                "invalid_request_error",
            )
        raw = await request.read()  # client_max_size bounds a body without a length
        if raw and not request.content_type.startswith("multipart/"):
            # Parsed once here, for the routes and the checks below. Every POST route
            # of llama-server takes JSON, so a body that does not parse (bad UTF-8,
            # deep nesting, syntax) is refused here, in the OpenAI error format.
            try:
                body = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError) as error:
                return error_response(400, f"request body is not valid JSON: {_why(error)}")
            request[JSON_BODY] = body
            problem = (
                out_of_vocab(request.path, body, settings.n_vocab)
                or bad_role(request.path, body)
                or bad_limit(request.path, body)
            )
            if problem:
                return error_response(400, problem)
        return await handler(request)

    return check_body


def _why(error: ValueError | RecursionError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"invalid UTF-8 at byte {error.start}"
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    return "nested too deeply"


def slot_middleware(settings: GuardSettings) -> Callable:
    @web.middleware
    async def check_slot_action(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and _SLOT_ACTION.match(request.path):
            if not settings.allow_slot_actions:
                return error_response(
                    403, "slot actions are disabled on this proxy", "permission_error"
                )
            body = parsed_body(request)
            filename = body.get("filename") if isinstance(body, dict) else None
            if isinstance(filename, str) and filename.startswith(RESERVED_SLOT_PREFIX):
                return error_response(
                    403,
                    f"slot file names starting with {RESERVED_SLOT_PREFIX!r} belong to the proxy",
                    "permission_error",
                )
        return await handler(request)

    return check_slot_action


def middlewares(settings: GuardSettings) -> list:
    # outermost first: errors wrap everything; the key is checked before the body is read
    return [
        error_middleware,
        auth_middleware(settings),
        body_middleware(settings),
        slot_middleware(settings),
    ]
