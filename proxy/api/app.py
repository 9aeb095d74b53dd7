"""The proxy's HTTP surface: speculative routes, own /metrics, pass-through for the rest."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api import formats, shapes
from proxy.api.errors import error_response, json_error_response, upstream_error_response
from proxy.api.guard import (
    OWN_ANSWER,
    PUBLIC_PATHS,
    RESERVED_SLOT_PREFIX,
    GuardSettings,
    middlewares,
    parsed_body,
)
from proxy.api.passthrough import HEADER, forward
from proxy.api.requests import (
    NotEligible,
    PromptSpec,
    SpecParams,
    parse_chat,
    parse_completion,
)
from proxy.api.tool_calls import ToolTriggers, server_stream
from proxy.config import ProxySettings
from proxy.drafter_guard import DrafterSupervisor
from proxy.engine import (
    AsyncDrafter,
    EngineSettings,
    Generation,
    GenerationParams,
    GenerationResult,
    SlotReplicator,
)
from proxy.engine.background import BackgroundTasks
from proxy.engine.server_text import PieceCache, TokenEvent
from proxy.metrics import ProxyMetrics, policy_page, reliability_page
from proxy.policies.load import LoadGate, LoadMeasures
from proxy.scheduler import SchedulerBusy
from proxy.server.upstream import UpstreamClient, UpstreamClientError, UpstreamError
from proxy.slot_share import SlotShare, Stream

log = logging.getLogger(__name__)
_request_ids = itertools.count(1)


@dataclass
class ProxyState:
    """What the routes share: the settings, the server's facts, and the objects the
    settings configure, built here once (the scheduler in build_state; the routes read
    only the retry and pass-through timings themselves)."""

    upstream: UpstreamClient
    settings: ProxySettings
    scheduler: SlotShare  # the server's slots, shared by every stream
    props: dict[str, Any]
    settings_template: dict[str, Any]  # generation_settings of a default greedy request
    open_drafter: Callable[[], AsyncDrafter] | None  # None: no drafter, everything passes
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    n_vocab: int | None = None  # the target's vocabulary (None: token ids unchecked)
    # what serve() started, not settings
    reload_drafter: Callable[[], Callable[[], AsyncDrafter]] | None = None
    replace_upstream_auth: bool = False  # the upstream key replaces the client's header
    server_restarts: Callable[[], int] | None = None  # managed mode: restarts so far

    def __post_init__(self) -> None:
        settings = self.settings
        self.guard = GuardSettings(
            api_key=settings.api_key,
            max_body_bytes=settings.max_body_bytes,
            allow_slot_actions=settings.allow_slot_actions,
            n_vocab=self.n_vocab,
        )
        self.pieces = PieceCache(self.upstream)
        self.replicator = SlotReplicator(
            self.upstream,
            reuse_files=settings.slot_file_reuse,
            copy_by_cost=settings.copy_by_cost,
            clear_stale_copies=settings.clear_stale_copies,
        )
        self.drafters = (
            DrafterSupervisor(
                self.open_drafter, self.reload_drafter, settings.draft_timeout_s, self.n_vocab
            )
            if self.open_drafter is not None
            else None
        )
        # Slot files the proxy writes: generated names, unguessable, and refused to
        # clients (guard.RESERVED_SLOT_PREFIX), so no request can swap their contents.
        self.slot_file_stem = f"{RESERVED_SLOT_PREFIX}{secrets.token_hex(8)}"
        self.engine_settings = EngineSettings.from_settings(settings)
        self.policies = self.engine_settings.policies()  # shared by every request
        self.client_disconnects = 0
        self.upstream_failures = 0  # speculative requests ended by a failing server
        self.tool_triggers = ToolTriggers(self.upstream)
        self.background = BackgroundTasks()  # what generations leave running

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
    settings: ProxySettings,
    upstream: UpstreamClient,
    open_drafter: Callable[[], AsyncDrafter] | None,
    scheduler: SlotShare | None = None,
    **started: Any,
) -> ProxyState:
    """Read the server's facts (props, settings template, vocabulary) and assemble the
    state. `started` takes the ProxyState fields of what serve() started (reload_drafter,
    replace_upstream_auth, server_restarts)."""
    props = await upstream.props()
    template = await probe_settings_template(upstream)
    if scheduler is None:
        scheduler = SlotShare(
            int(props.get("total_slots", 1)),
            settings.k + 1,
            settings.when_busy,
            settings.queue_timeout_s,
            settings.max_queue,
            settings.max_streams,
            LoadGate(settings.under_load),
        )
    state = ProxyState(
        upstream=upstream,
        settings=settings,
        scheduler=scheduler,
        props=props,
        settings_template=template,
        open_drafter=open_drafter,
        n_vocab=await _vocab_size(upstream),
        **started,
    )
    if scheduler.gate.measure is None:
        scheduler.gate.measure = lambda: _load_measures(state)
    return state


def _load_measures(state: ProxyState) -> LoadMeasures:
    """What the load gate weighs: the greedy gate's rates alone, and what one more
    token in a verify batch costs (the draft-length policy's fitted slope)."""
    runs = state.policies.plain_runs.snapshot()
    lengths = state.policies.draft_length.snapshot()
    return LoadMeasures(
        plain_ms_per_token=runs["plain_ms_per_token"],
        spec_ms_per_token=runs["spec_ms_per_token"],
        batch_token_ms=lengths["verify_ms_per_draft"] if lengths["rounds"] else None,
    )


async def _vocab_size(upstream: UpstreamClient) -> int | None:
    try:
        models = await upstream.models()
        meta = (models.get("data") or [{}])[0].get("meta") or {}
        return int(meta["n_vocab"])
    except (UpstreamError, UpstreamClientError, KeyError, TypeError, ValueError, IndexError):
        return None  # token ids then go to the server unchecked


def create_app(state: ProxyState) -> web.Application:
    # client_max_size: bodies without a Content-Length are cut off at the limit too
    app = web.Application(
        client_max_size=state.guard.max_body_bytes, middlewares=middlewares(state.guard)
    )
    app[STATE] = state
    app.router.add_post("/completion", completion_native)
    app.router.add_post("/completions", completion_native)
    app.router.add_post("/v1/completions", completion_oai)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    for path in PUBLIC_PATHS:
        app.router.add_get(path, health)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    app.on_cleanup.append(lambda _app: state.background.close())
    return app


# -- plain routes --------------------------------------------------------------------


async def passthrough(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.metrics.observe_request("passthrough")
    return await _forward(request, state)


async def _forward(
    request: web.Request,
    state: ProxyState,
    body: bytes | None = None,
    on_first_chunk: Callable[[], None] | None = None,
) -> web.StreamResponse:
    return await forward(
        request,
        state.upstream,
        body,
        replace_auth=state.replace_upstream_auth,
        read_timeout_s=state.settings.passthrough_read_timeout_s,
        on_first_chunk=on_first_chunk,
    )


async def metrics(request: web.Request) -> web.Response:
    """The proxy's counters, followed by the server's own when it exposes them."""
    state = request.app[STATE]
    drafters = state.drafters.snapshot() if state.drafters is not None else {}
    restarts = state.server_restarts() if state.server_restarts is not None else None
    page = (
        state.metrics.render()
        + reliability_page(
            state.scheduler, drafters, state.client_disconnects, state.upstream_failures, restarts
        )
        + policy_page(state.policies)
    )
    page += state.scheduler.render_metrics()
    try:
        page += await state.upstream.metrics_text()
    except UpstreamError as exc:
        log.debug("no upstream metrics: %s", exc)
    response = web.Response(text=page, content_type="text/plain")
    response.headers[HEADER] = OWN_ANSWER
    return response


async def health(request: web.Request) -> web.Response:
    """The proxy's own health: llama-server's /health answer (status and body, so
    health checks read it as they read the server's), marked as the proxy's."""
    upstream = request.app[STATE].upstream
    timeout = aiohttp.ClientTimeout(total=upstream.timeouts.control)
    try:
        async with await upstream.request("GET", "/health", timeout=timeout) as answer:
            body, content_type = await answer.read(), answer.content_type
            status = answer.status
    except TimeoutError:
        error = UpstreamError(upstream.base_url, "GET /health timed out", 504)
        return upstream_error_response(error, spec_header=OWN_ANSWER)
    except aiohttp.ClientError as exc:
        error = UpstreamError(upstream.base_url, f"GET /health: {exc}", 503)
        return upstream_error_response(error, spec_header=OWN_ANSWER)
    return web.Response(
        status=status, body=body, content_type=content_type, headers={HEADER: OWN_ANSWER}
    )


PLAIN_PREFERRED = "plain decoding is measured faster than speculating here"


def _pass_while_plain_preferred(state: ProxyState, params: SpecParams) -> None:
    """While plain runs are the measured choice, requests go to llama-server whole
    (its own decoding loop and streaming), except the ones that re-measure; checked
    before the prompt is tokenized."""
    gate = state.policies.gate_for(params.sampling)
    if gate is not None and gate.pass_through():
        raise NotEligible(PLAIN_PREFERRED)


def _retry_after(state: ProxyState, response: web.Response) -> web.Response:
    response.headers["Retry-After"] = str(state.settings.retry_after_s)
    return response


def busy_response(state: ProxyState, message: str) -> web.Response:
    return _retry_after(state, error_response(503, message, spec_header="speculative"))


def _upstream_failure(state: ProxyState, exc: UpstreamError) -> web.Response:
    state.upstream_failures += 1
    response = upstream_error_response(exc, spec_header="speculative")
    if response.status == 503:  # down or restarting: worth retrying shortly
        _retry_after(state, response)
    return response


# -- speculative routes --------------------------------------------------------------


@dataclass
class RequestPrompt:
    """A speculative request's prompt, read by its route."""

    params: SpecParams
    tokens: list[int]
    text: str  # the prompt as the server prints it back
    triggers: list[str] = field(default_factory=list)  # tool-call triggers: the engine stops there


PromptReader = Callable[[ProxyState, dict[str, Any]], Awaitable[RequestPrompt]]


async def completion_native(request: web.Request) -> web.StreamResponse:
    return await _serve(request, _read_native_completion, formats.NativeCompletion)


async def completion_oai(request: web.Request) -> web.StreamResponse:
    return await _serve(request, _read_oai_completion, formats.OaiCompletion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, _read_chat, formats.ChatCompletion)


async def _read_chat(state: ProxyState, body: dict[str, Any]) -> RequestPrompt:
    params = parse_chat(body, state.defaults)
    _pass_while_plain_preferred(state, params)
    triggers = await state.tool_triggers.words(body) if params.offers_tools else []
    prompt_text = await state.upstream.apply_template(body)
    tokens = await state.upstream.tokenize(prompt_text, add_special=True)
    return RequestPrompt(params, tokens, prompt_text, triggers)


async def _read_completion(state: ProxyState, body: dict[str, Any], oai: bool) -> RequestPrompt:
    prompt, params = parse_completion(body, state.defaults, oai=oai)
    _pass_while_plain_preferred(state, params)
    tokens = await _tokenize_prompt(state.upstream, prompt)
    prompt_text = await state.upstream.detokenize(tokens)
    return RequestPrompt(params, tokens, prompt_text)


async def _read_native_completion(state: ProxyState, body: dict[str, Any]) -> RequestPrompt:
    return await _read_completion(state, body, oai=False)


async def _read_oai_completion(state: ProxyState, body: dict[str, Any]) -> RequestPrompt:
    return await _read_completion(state, body, oai=True)


async def _tokenize_prompt(upstream: UpstreamClient, prompt: PromptSpec) -> list[int]:
    # The server tokenizes request prompts with add_special and parse_special on.
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return await upstream.tokenize(prompt, add_special=True, parse_special=True)


async def _serve(
    request: web.Request, read: PromptReader, response_format: type[formats.ResponseFormat]
) -> web.StreamResponse:
    try:
        return await _serve_request(request, read, response_format)
    except asyncio.CancelledError:
        # The client went away, at whatever point: a queued waiter was removed, the
        # engine's finally closed the draft session, the slot group went back, and
        # closing the verify request made llama-server drop its tasks.
        request.app[STATE].client_disconnects += 1
        raise


async def _serve_request(
    request: web.Request, read: PromptReader, response_format: type[formats.ResponseFormat]
) -> web.StreamResponse:
    """Admit the request as one stream of the server's slots (at once while a slot has
    no stream; else it queues, or gets 503), serve it, and give the slot back."""
    state = request.app[STATE]
    arrived = time.perf_counter()
    raw = await request.read()
    body = parsed_body(request)  # the guard parsed every non-empty body
    try:
        stream = await state.scheduler.admit(
            state.drafters is not None and body is not None, arrived
        )
    except SchedulerBusy as exc:  # the queue is full, or it waited the queue timeout
        return busy_response(state, str(exc))
    try:
        return await _serve_stream(request, read, response_format, raw, body, stream)
    finally:
        state.scheduler.release(stream)


async def _serve_stream(
    request: web.Request,
    read: PromptReader,
    response_format: type[formats.ResponseFormat],
    raw: bytes,
    body: dict[str, Any] | None,
    stream: Stream,
) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = f"r{next(_request_ids)}"
    share = state.scheduler
    streamed = isinstance(body, dict) and bool(body.get("stream"))
    first_token = (lambda: share.first_token(stream)) if streamed else None

    async def pass_on(reason: str) -> web.StreamResponse:
        log.info("[%s] %s %s: pass-through (%s)", request_id, request.method, request.path, reason)
        stream.speculative = False
        state.metrics.observe_request("passthrough")
        response = await _forward(request, state, raw, first_token)
        if share.streams <= 1:  # alone: the server keeps this context, not earlier ones
            state.background.start(state.replicator.keep_latest())
        return response

    if state.drafters is None:
        return await pass_on("no drafter configured")
    if body is None:
        return await pass_on("no body: the server answers with its own error")
    if not stream.speculative:
        return await pass_on(
            f"{share.streams - 1} other stream(s): llama-server's own batching serves them "
            "better than speculating here"
        )
    try:
        prompt = await read(state, body)
    except NotEligible as exc:
        return await pass_on(str(exc))
    except UpstreamClientError as exc:
        return await pass_on(f"server refused a helper call: {exc}")
    except UpstreamError as exc:
        return _upstream_failure(state, exc)
    if not prompt.tokens:
        return await pass_on("empty prompt")
    vocab = state.guard.n_vocab
    if vocab is not None and any(not 0 <= t < vocab for t in prompt.tokens):
        # the server's own answer for such a prompt (server-common.cpp validate)
        return error_response(400, "Prompt contains invalid tokens", spec_header="speculative")

    state.metrics.observe_request("speculative")
    answer = response_format(_response_context(state, body, prompt))
    generation = await _start_generation(
        state, prompt.tokens, prompt.params, prompt.triggers, stream, request_id
    )
    n_prompt = len(prompt.tokens)
    log.info("[%s] %s: speculative, %d prompt tokens", request_id, request.path, n_prompt)
    tool_call = ToolCallStart(prompt.triggers, prompt.params.stop, body)
    if prompt.params.stream:
        return await _stream(request, state, answer, generation, tool_call, first_token)
    response = await _complete(state, answer, generation, tool_call)
    if response is None:  # the model started a tool call: the server writes it
        return await pass_on("the model started a tool call")
    return response


def _response_context(
    state: ProxyState, body: dict[str, Any], prompt: RequestPrompt
) -> shapes.ResponseContext:
    params = prompt.params
    return shapes.ResponseContext(
        model=state.model_name,
        build_info=state.build_info,
        n_prompt=len(prompt.tokens),
        prompt_text=prompt.text,
        generation_settings=shapes.generation_settings(
            state.settings_template, body, params.n_predict, params.stop, params.stream
        ),
        include_usage=params.include_usage,
        return_tokens=bool(body.get("return_tokens", False)),
        timings_per_token=params.timings_per_token,
        return_progress=params.return_progress,
        reasoning_format=params.reasoning_format,
    )


async def _start_generation(
    state: ProxyState,
    tokens: list[int],
    params: SpecParams,
    triggers: list[str],
    stream: Stream,
    request_id: str,
) -> Generation:
    """The engine's generation for one request, sharing the slots as `stream`."""
    return Generation(
        state.upstream,
        tokens,
        GenerationParams(
            n_predict=params.n_predict,
            stop=params.stop + [t for t in triggers if t not in params.stop],
            sampling=params.sampling,
        ),
        n_ctx=state.n_ctx,
        drafter=await state.drafters.open(),
        guard=state.drafters,
        background=state.background,
        pieces=state.pieces,
        observer=state.metrics,
        settings=state.engine_settings,
        request_id=request_id,
        replicator=state.replicator,
        slot_file=f"{state.slot_file_stem}-g{stream.group}.bin",  # one file per stream
        policies=state.policies.for_request(params.sampling, state.scheduler.lease(stream)),
    )


@dataclass
class ToolCallStart:
    """Whether a generation stopped where the server's tool-call grammar wakes up."""

    triggers: list[str]
    stop: list[str]  # the client's own stop words
    body: dict[str, Any]  # the request, for the server to write the tool call

    def reached(self, result: GenerationResult) -> bool:
        return (
            result.stop_type == "word"
            and result.stopping_word in self.triggers
            and result.stopping_word not in self.stop
        )


def _spec_json(body: dict[str, Any]) -> web.Response:
    response = web.Response(text=shapes.dumps(body), content_type="application/json")
    response.headers[HEADER] = "speculative"
    return response


def _engine_error(state: ProxyState, exc: Exception) -> web.Response:
    if isinstance(exc, UpstreamClientError):
        return json_error_response(exc.status, exc.body, spec_header="speculative")
    if isinstance(exc, UpstreamError):
        return _upstream_failure(state, exc)
    log.error("speculative generation failed: %r", exc, exc_info=exc)
    return error_response(500, f"speculative generation failed: {exc}", spec_header="speculative")


async def _complete(
    state: ProxyState,
    answer: formats.ResponseFormat,
    generation: Generation,
    tool_call: ToolCallStart,
) -> web.Response | None:
    """The response, or None when the model started a tool call."""
    try:
        async for _event in generation.run():
            pass
    except Exception as exc:  # every failure becomes a JSON error
        return _engine_error(state, exc)
    result = generation.result
    assert result is not None
    if tool_call.reached(result):
        return None
    return _spec_json(answer.body(result))


@dataclass
class _StreamClock:
    """When the request started and its first token came: the running timings."""

    started: float
    first_token_at: float

    @property
    def prompt_ms(self) -> float:
        return (self.first_token_at - self.started) * 1e3

    def running_timings(self, ctx: shapes.ResponseContext, event: TokenEvent) -> dict | None:
        if not ctx.timings_per_token:
            return None
        predicted_ms = (time.perf_counter() - self.first_token_at) * 1e3
        return shapes.running_timings(ctx.n_prompt, event.n_decoded, self.prompt_ms, predicted_ms)


async def _write_chunks(response: web.StreamResponse, chunks: list[dict[str, Any]]) -> None:
    for chunk in chunks:
        await response.write(shapes.sse(chunk))


async def _stream(
    request: web.Request,
    state: ProxyState,
    answer: formats.ResponseFormat,
    generation: Generation,
    tool_call: ToolCallStart,
    on_first_token: Callable[[], None] | None = None,
) -> web.StreamResponse:
    started = time.perf_counter()
    events = generation.run()
    # As the server does, an error before the first token is a plain JSON error.
    try:
        first: TokenEvent | None = await anext(events)
    except StopAsyncIteration:
        first = None
    except Exception as exc:  # every failure becomes a JSON error
        await events.aclose()
        return _engine_error(state, exc)
    response = web.StreamResponse(status=200)
    response.content_type = "text/event-stream"
    response.headers[HEADER] = "speculative"
    await response.prepare(request)
    if on_first_token is not None:
        on_first_token()
    clock = _StreamClock(started, first_token_at=time.perf_counter())
    if answer.ctx.return_progress:
        await _write_progress(response, answer, clock)
    try:
        held = await _stream_tokens(response, answer, events, first, clock)
        result = generation.result
        assert result is not None
        if tool_call.reached(result):  # the server writes the tool call and the end
            server = [e async for e in server_stream(state.upstream, tool_call.body)]
            await _write_chunks(response, answer.tool_call_chunks(server))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if held is not None:
            await _write_chunks(response, answer.token_chunks(held, result.timings()))
        await _write_chunks(response, answer.end_chunks(result))
        if answer.ends_with_done:
            await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        await events.aclose()
        raise
    except Exception as exc:
        # The stream already said 200: end it with an error event, as llama-server
        # does, and without the final chunk or [DONE], so no client can take the
        # truncated text for a complete answer.
        await response.write(shapes.sse({"error": _stream_error(state, exc)}))
    finally:
        await events.aclose()
    await response.write_eof()
    return response


async def _write_progress(
    response: web.StreamResponse, answer: formats.ResponseFormat, clock: _StreamClock
) -> None:
    # The server reports the prompt's start and its end (one batch for the prompts
    # served here); the engine's prompt work is over once the first token exists.
    n_prompt = answer.ctx.n_prompt
    for processed, time_ms in ((0, 0.0), (n_prompt, clock.prompt_ms)):
        progress = shapes.prompt_progress(n_prompt, processed, time_ms)
        await response.write(shapes.sse(answer.progress_chunk(progress)))


async def _stream_tokens(
    response: web.StreamResponse,
    answer: formats.ResponseFormat,
    events: AsyncIterator[TokenEvent],
    first: TokenEvent | None,
    clock: _StreamClock,
) -> TokenEvent | None:
    """Send each token's chunks as it comes; returns the held chunk of a token that
    ended on a stop word, which carries the final timings."""
    held: TokenEvent | None = None
    event = first
    while event is not None:
        if event.sent:
            if event.stopped_by_word:
                held = event
            else:
                timings = clock.running_timings(answer.ctx, event)
                await _write_chunks(response, answer.token_chunks(event, timings))
        try:
            event = await anext(events)
        except StopAsyncIteration:
            event = None
    return held


def _stream_error(state: ProxyState, exc: Exception) -> dict[str, Any]:
    if isinstance(exc, UpstreamClientError):
        return exc.body.get("error", {}) or {"code": exc.status, "message": str(exc)}
    if isinstance(exc, UpstreamError):
        state.upstream_failures += 1
        log.warning("stream ended by the upstream: %s", exc)
        return {
            "code": 503 if exc.status in (503, 504) else 502,
            "message": f"generation interrupted: {exc}",
            "type": "unavailable_error",
        }
    log.error("speculative stream failed: %r", exc, exc_info=exc)
    return {
        "code": 500,
        "message": f"generation interrupted: {exc}",
        "type": "server_error",
    }
