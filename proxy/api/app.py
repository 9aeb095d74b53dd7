"""The proxy's HTTP surface: speculative routes, own /metrics, pass-through for the rest."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.api import shapes
from proxy.api.errors import json_error_response, upstream_error_response
from proxy.api.passthrough import HEADER, forward
from proxy.api.requests import NotEligible, PromptSpec, parse_chat, parse_completion
from proxy.engine import (
    AsyncDrafter,
    Generation,
    GenerationParams,
    PieceCache,
    SlotReplicator,
    TokenEvent,
)
from proxy.metrics import ProxyMetrics
from proxy.scheduler import SchedulerBusy, SlotScheduler
from proxy.upstream import UpstreamClient, UpstreamClientError, UpstreamError

log = logging.getLogger(__name__)
_request_ids = itertools.count(1)


@dataclass
class ProxyState:
    upstream: UpstreamClient
    scheduler: SlotScheduler
    metrics: ProxyMetrics
    props: dict[str, Any]
    k: int
    open_drafter: Callable[[], AsyncDrafter] | None  # None: no drafter, everything passes
    settings_template: dict[str, Any]  # generation_settings of a default greedy request
    check_decodes: bool = False
    strict_decodes: bool = False

    replicate_prefill: bool = True

    def __post_init__(self) -> None:
        self.pieces = PieceCache(self.upstream)
        self.replicator = SlotReplicator(self.upstream) if self.replicate_prefill else None

    @property
    def defaults(self) -> dict[str, Any]:
        return self.props["default_generation_settings"]["params"]

    @property
    def n_ctx(self) -> int:
        return int(self.props["default_generation_settings"]["n_ctx"])

    @property
    def model_name(self) -> str:
        return self.props.get("model_alias") or self.props.get("model_path", "")

    @property
    def build_info(self) -> str:
        return self.props.get("build_info", "")


STATE = web.AppKey("state", ProxyState)


async def probe_settings_template(upstream: UpstreamClient) -> dict[str, Any]:
    """Ask the server once, at start-up, for its full `generation_settings` object."""
    body = {
        "prompt": [0],
        "n_predict": 1,
        "temperature": 0.0,
        "cache_prompt": False,
        "response_fields": ["generation_settings"],
    }
    payload = await upstream.completion(body)
    return payload["generation_settings"]


async def build_state(
    upstream: UpstreamClient,
    k: int,
    open_drafter: Callable[[], AsyncDrafter] | None,
    scheduler: SlotScheduler | None = None,
    check_decodes: bool = False,
    strict_decodes: bool = False,
    when_busy: str = "queue",
    queue_timeout_s: float = 300.0,
    replicate_prefill: bool = True,
) -> ProxyState:
    """Read the server's facts (props, settings template) and assemble the state."""
    props = await upstream.props()
    template = await probe_settings_template(upstream)
    if scheduler is None:
        scheduler = SlotScheduler(
            int(props.get("total_slots", 1)), k + 1, when_busy, queue_timeout_s
        )
    return ProxyState(
        upstream=upstream,
        scheduler=scheduler,
        metrics=ProxyMetrics(),
        props=props,
        k=k,
        open_drafter=open_drafter,
        settings_template=template,
        check_decodes=check_decodes,
        strict_decodes=strict_decodes,
        replicate_prefill=replicate_prefill,
    )


def create_app(state: ProxyState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app.router.add_post("/completion", completion_native)
    app.router.add_post("/completions", completion_native)
    app.router.add_post("/v1/completions", completion_oai)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


# -- plain routes --------------------------------------------------------------------


async def passthrough(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.metrics.observe_request("passthrough")
    return await forward(request, state.upstream)


async def metrics(request: web.Request) -> web.Response:
    """The proxy's counters, followed by the server's own when it exposes them."""
    state = request.app[STATE]
    page = state.metrics.render()
    try:
        page += await state.upstream.metrics_text()
    except UpstreamError as exc:
        log.debug("no upstream metrics: %s", exc)
    response = web.Response(text=page, content_type="text/plain")
    response.headers[HEADER] = "speculative"
    return response


# -- speculative routes --------------------------------------------------------------


async def completion_native(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "native")


async def completion_oai(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "oai")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def _tokenize_prompt(upstream: UpstreamClient, prompt: PromptSpec) -> list[int]:
    # The server tokenizes request prompts with add_special and parse_special on.
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return await upstream.tokenize(prompt, add_special=True, parse_special=True)


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = f"r{next(_request_ids)}"
    raw = await request.read()

    async def pass_on(reason: str) -> web.StreamResponse:
        log.info("[%s] %s %s: pass-through (%s)", request_id, request.method, request.path, reason)
        state.metrics.observe_request("passthrough")
        return await forward(request, state.upstream, raw)

    if state.open_drafter is None:
        return await pass_on("no drafter configured")
    try:
        body = json.loads(raw)
    except ValueError:
        return await pass_on("invalid JSON: the server answers with its own error")
    try:
        if kind == "chat":
            params = parse_chat(body, state.defaults)
            prompt_text = await state.upstream.apply_template(body)
            tokens = await state.upstream.tokenize(prompt_text, add_special=True)
        else:
            prompt, params = parse_completion(body, state.defaults, oai=kind == "oai")
            tokens = await _tokenize_prompt(state.upstream, prompt)
            prompt_text = await state.upstream.detokenize(tokens)
    except NotEligible as exc:
        return await pass_on(str(exc))
    except UpstreamClientError as exc:
        return await pass_on(f"server refused a helper call: {exc}")
    except UpstreamError as exc:
        return upstream_error_response(exc, spec_header="speculative")
    if not tokens:
        return await pass_on("empty prompt")

    try:
        group = await state.scheduler.acquire()
    except SchedulerBusy as exc:
        return await pass_on(str(exc))
    try:
        state.metrics.observe_request("speculative")
        ctx = shapes.ResponseContext(
            model=state.model_name,
            build_info=state.build_info,
            n_prompt=len(tokens),
            prompt_text=prompt_text,
            generation_settings=shapes.generation_settings(
                state.settings_template, body, params.n_predict, params.stop, params.stream
            ),
            include_usage=params.include_usage,
            return_tokens=bool(body.get("return_tokens", False)),
        )
        generation = Generation(
            state.upstream,
            tokens,
            GenerationParams(n_predict=params.n_predict, stop=params.stop, k=state.k),
            n_ctx=state.n_ctx,
            drafter=state.open_drafter(),
            pieces=state.pieces,
            observer=state.metrics,
            check_decodes=state.check_decodes,
            strict_decodes=state.strict_decodes,
            request_id=request_id,
            replicator=state.replicator,
            slot_file=f"npu-spec-group-{group}.bin",  # one file per group: no clashes
        )
        log.info("[%s] %s: speculative, %d prompt tokens", request_id, request.path, len(tokens))
        if params.stream:
            return await _stream(request, kind, generation, ctx, prompt_text)
        return await _complete(kind, generation, ctx, prompt_text)
    finally:
        state.scheduler.release(group)


def _spec_json(body: dict[str, Any]) -> web.Response:
    response = web.Response(text=shapes.dumps(body), content_type="application/json")
    response.headers[HEADER] = "speculative"
    return response


def _engine_error(exc: Exception) -> web.Response:
    if isinstance(exc, UpstreamClientError):
        return json_error_response(exc.status, exc.body, spec_header="speculative")
    assert isinstance(exc, UpstreamError)
    return upstream_error_response(exc, spec_header="speculative")


async def _complete(
    kind: str, generation: Generation, ctx: shapes.ResponseContext, prompt_text: str
) -> web.Response:
    try:
        async for _event in generation.run():
            pass
    except (UpstreamClientError, UpstreamError) as exc:
        return _engine_error(exc)
    result = generation.result
    assert result is not None
    if kind == "native":
        return _spec_json(shapes.native_final(ctx, result, False, ctx.return_tokens))
    if kind == "oai":
        return _spec_json(shapes.oai_completion_final(ctx, result, stream=False))
    message = shapes.split_reasoning(
        shapes.text(result.content), shapes.thinking_prefix(prompt_text)
    )
    return _spec_json(shapes.chat_final(ctx, result, message))


class _ChatStreamState:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.text = ""
        self.message = shapes.ChatMessage(content="")

    def update(self, added: str) -> dict[str, Any] | None:
        self.text += added
        parsed = shapes.split_reasoning(self.text, self.prefix)
        diff = shapes.chat_diff(self.message, parsed)
        self.message = parsed
        return diff


async def _stream(
    request: web.Request,
    kind: str,
    generation: Generation,
    ctx: shapes.ResponseContext,
    prompt_text: str,
) -> web.StreamResponse:
    events = generation.run()
    # As the server does, an error before the first token is a plain JSON error.
    try:
        first: TokenEvent | None = await anext(events)
    except StopAsyncIteration:
        first = None
    except (UpstreamClientError, UpstreamError) as exc:
        return _engine_error(exc)
    response = web.StreamResponse(status=200)
    response.content_type = "text/event-stream"
    response.headers[HEADER] = "speculative"
    await response.prepare(request)
    chat = _ChatStreamState(shapes.thinking_prefix(prompt_text)) if kind == "chat" else None
    held: TokenEvent | None = None  # a stop-word token's chunk carries the final timings

    async def emit(event: TokenEvent, timings: dict | None = None) -> None:
        if kind == "native":
            await response.write(shapes.sse(shapes.native_partial(ctx, event, timings)))
        elif kind == "oai":
            await response.write(shapes.sse(shapes.oai_completion_partial(ctx, event, timings)))
        else:
            assert chat is not None
            chunks = []
            if event.n_decoded == 1:
                chunks.append(shapes.chat_chunk(ctx, {"role": "assistant", "content": None}))
            diff = chat.update(shapes.text(event.text))
            if diff:
                chunks.append(shapes.chat_chunk(ctx, diff))
            if chunks and timings is not None:
                chunks[-1]["timings"] = timings
            for chunk in chunks:
                await response.write(shapes.sse(chunk))

    try:
        event = first
        while event is not None:
            if event.sent:
                if event.stopped_by_word:
                    held = event
                else:
                    await emit(event)
            try:
                event = await anext(events)
            except StopAsyncIteration:
                event = None
        result = generation.result
        assert result is not None
        if held is not None:
            await emit(held, result.timings())
        if kind == "native":
            await response.write(
                shapes.sse(shapes.native_final(ctx, result, True, ctx.return_tokens))
            )
        elif kind == "oai":
            await response.write(shapes.sse(shapes.oai_completion_final(ctx, result, stream=True)))
            await response.write(b"data: [DONE]\n\n")
        else:
            assert chat is not None
            for chunk in shapes.chat_final_chunks(ctx, result, chat.update("")):
                await response.write(shapes.sse(chunk))
            await response.write(b"data: [DONE]\n\n")
    except (UpstreamClientError, UpstreamError) as exc:
        error = exc.body.get("error", {}) if isinstance(exc, UpstreamClientError) else {
            "code": 503 if exc.status in (503, 504) else 502,
            "message": str(exc),
            "type": "unavailable_error",
        }  # fmt: skip
        await response.write(shapes.sse({"error": error}))
    except (ConnectionResetError, asyncio.CancelledError):
        await events.aclose()
        raise
    finally:
        await events.aclose()
    await response.write_eof()
    return response
