"""The regime server's HTTP routes: llama-server b11434's shapes for what the proxy,
the bench and verify-cost use (/completion, /tokenize, /detokenize, /apply-template,
/v1/chat/completions, /slots and the slot actions, /props, /health, /metrics,
/v1/models).

Host-side work is charged per request before its tasks are queued (the real server
parses and checks the prompts on its HTTP thread); the time this process really
spent on the request counts against that charge.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.bench.regime.engine import WAKE_UP, RegimeEngine, Task
from proxy.bench.regime.regime_file import Regime
from proxy.bench.regime.target import ScriptedTarget

BUILD = "b11434"
AFTER_WEIGHT = 0.2  # the running mean of the response's own cost
# stands for a saved state's size (the real one depends on the model; only reported)
STATE_BYTES_PER_TOKEN = 64
_FILENAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


@dataclass
class ServerOptions:
    model_path: str
    n_slots: int
    n_ctx: int
    unified: bool
    metrics: bool
    slot_save_path: Path | None
    api_key: str | None = None
    alias: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"code": status, "message": message, "type": kind}}
    return web.json_response(body, status=status)


class BadRequest(Exception):
    pass


def _pick(payload: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's `response_fields`: keep these paths ('a/b' reads payload[a][b]),
    keyed by the path as written."""
    if not fields:
        return payload
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = payload
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                value = None
                break
            value = value[part]
        if value is not None:
            out[path] = value
    return out


class RegimeApi:
    def __init__(
        self, regime: Regime, target: ScriptedTarget, engine: RegimeEngine, options: ServerOptions
    ) -> None:
        self.regime = regime
        self.target = target
        self.engine = engine
        self.options = options
        self.saved: dict[str, list[int]] = {}  # slot files, kept in memory
        # this process's own work on a request after its tasks end (the response): the
        # host charge is its share of the real machine's, so it makes room for this
        self._after_ms = 0.0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/props", self.props)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/models", self.models)
        app.router.add_get("/slots", self.slots)
        app.router.add_post("/slots/{id}", self.slot_action)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/apply-template", self.apply_template)
        app.router.add_post("/completion", self.completion)
        app.router.add_post("/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/chat/completions", self.chat)
        app.on_startup.append(lambda _: self._start())
        app.on_cleanup.append(lambda _: self.engine.stop())
        return app

    async def _start(self) -> None:
        self.engine.start()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.options.api_key
        public = request.path in ("/health", "/v1/health", "/models", "/v1/models")
        if key and not public and request.headers.get("Authorization") != f"Bearer {key}":
            return _error(401, "Invalid API Key", "authentication_error")
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc))

    # -- small routes ---------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "default_generation_settings": {
                    "id": 0,
                    "n_ctx": self.engine.n_ctx_slot,
                    "speculative": False,
                    "is_processing": False,
                    "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40},
                },
                "total_slots": len(self.engine.slots),
                "model_alias": self.options.alias or Path(self.options.model_path).name,
                "model_path": self.options.model_path,
                "modalities": {"vision": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": self.options.metrics,
                "chat_template": self.target.chat_template or "",
                "bos_token": "",
                "eos_token": "<|im_end|>",
                "build_info": f"{BUILD}-regime-{self.regime.name}",
                "is_sleeping": False,
            }
        )

    async def models(self, _: web.Request) -> web.Response:
        name = self.options.alias or self.options.model_path
        meta = {"vocab_type": 2, "n_vocab": self.target.n_vocab, "n_ctx_train": 40960}
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": int(time.time()),
                          "owned_by": "llamacpp", "meta": meta}],
                "models": [{"name": name, "model": name}],
            }
        )  # fmt: skip

    async def slots(self, _: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "id": slot.id,
                    "id_task": slot.id_task,
                    "n_ctx": self.engine.n_ctx_slot,
                    "speculative": False,
                    "is_processing": slot.busy,
                    "n_prompt_tokens": len(slot.cache),
                }
                for slot in self.engine.slots
            ]
        )

    async def metrics(self, _: web.Request) -> web.Response:
        if not self.options.metrics:
            return _error(
                501, "This server does not support metrics endpoint.", "not_supported_error"
            )
        c = self.engine.counters
        counters = {
            "prompt_tokens_total": c.prompt_tokens,
            "prompt_tokens_cached_total": c.prompt_cached,
            "prompt_seconds_total": c.prompt_seconds,
            "tokens_predicted_total": c.predicted_tokens,
            "tokens_predicted_seconds_total": c.predicted_seconds,
            "n_decode_total": c.n_decode,
            "n_tokens_max": c.n_tokens_max,
        }
        gauges = {
            "prompt_tokens_seconds": c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0,
            "predicted_tokens_seconds": (
                c.predicted_tokens / c.predicted_seconds if c.predicted_seconds else 0
            ),
            "requests_processing": self.engine.processing,
            "requests_deferred": self.engine.deferred,
            "n_busy_slots_per_decode": c.n_busy_slots / max(c.n_decode, 1),
        }
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, value in items.items():
                # the server prints with ostream's default: 6 significant digits
                lines += [f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value:.6g}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        content = body.get("content", "")
        tokens = self.target.tokenize_mixed(content, bool(body.get("parse_special", True)))
        if not body.get("with_pieces"):
            return web.json_response({"tokens": tokens})
        out = []
        for token in tokens:
            piece = self.target.piece(token)
            try:
                shown: Any = piece.decode("utf-8")
            except UnicodeDecodeError:
                shown = list(piece)
            out.append({"id": token, "piece": shown})
        return web.json_response({"tokens": out})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        return web.json_response({"content": self.target.detokenize(body.get("tokens", []))})

    async def apply_template(self, request: web.Request) -> web.Response:
        body = await _json(request)
        prompt = self._template(body)
        return web.json_response({"prompt": prompt})

    def _template(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required")
        kwargs = body.get("chat_template_kwargs") or {}
        try:
            return self.target.apply_template(messages, **kwargs)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc

    # -- slot actions ---------------------------------------------------------------

    async def slot_action(self, request: web.Request) -> web.Response:
        if self.options.slot_save_path is None:
            return _error(
                501,
                "This server does not support slots action. Start it with `--slot-save-path`",
                "not_supported_error",
            )
        try:
            requested = int(request.match_info["id"])
        except ValueError:
            return _error(400, "Invalid slot ID")
        if requested < 0:
            return _error(400, "Invalid slot ID")
        slot = self.engine.slots[requested % len(self.engine.slots)]  # the server wraps ids
        action = request.query.get("action", "")
        filename = ""
        if action in ("save", "restore"):
            body = await _json(request)
            filename = str(body.get("filename", ""))
            if not _FILENAME.match(filename) or filename in (".", ".."):
                return _error(400, "Invalid filename")
        elif action != "erase":
            return _error(400, "Invalid action")
        while slot.busy:  # the server defers an action on a busy slot until its release
            await asyncio.sleep(0.001)
        cost = self.regime.slots
        if action == "erase":
            n = await self.engine.run_exclusive(lambda: self.engine.erase(slot), lambda _: 0.0)
            return web.json_response({"id_slot": requested, "n_erased": n})
        pool = self.engine.pool
        if action == "save":
            span = pool.n_kv(slot.id)
            tokens = await self.engine.run_exclusive(
                lambda: list(slot.cache), lambda t: cost.save_ms(len(t), span)
            )
            self.saved[filename] = tokens
            return web.json_response(
                {"id_slot": requested, "filename": filename, "n_saved": len(tokens),
                 "n_written": len(tokens) * STATE_BYTES_PER_TOKEN,
                 "timings": {"save_ms": cost.save_ms(len(tokens), span)}}
            )  # fmt: skip
        tokens = self.saved.get(filename)

        def restore() -> str | None:
            if tokens is None:
                self.engine.erase(slot)
                return "failed to open file"
            if len(tokens) > self.engine.pool.free_cells(slot.id) + len(slot.cache):
                self.engine.erase(slot)
                return "No available space in KV cache or invalid slot save file"
            self.engine.set_cache(slot, tokens)
            return None

        span = pool.n_kv(slot.id)  # before: the restored cells come on top
        failure = await self.engine.run_exclusive(
            restore, lambda f: 0.0 if f else cost.restore_ms(len(tokens or []), span)
        )
        if failure:
            return _error(400, f"Unable to restore slot: {failure}")
        assert tokens is not None
        return web.json_response(
            {"id_slot": requested, "filename": filename, "n_restored": len(tokens),
             "n_read": len(tokens) * STATE_BYTES_PER_TOKEN,
             "timings": {"restore_ms": cost.restore_ms(len(tokens), span)}}
        )  # fmt: skip

    # -- generation -------------------------------------------------------------------

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """llama-server's prompt forms: text, ids, text and ids mixed, or a list of
        those (several prompts)."""
        if isinstance(prompt, list) and any(isinstance(p, list) for p in prompt):
            prompts = [self.target.tokenize_mixed(p) for p in prompt]
        elif (
            isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt)
        ):
            prompts = [self.target.tokenize(p) for p in prompt]
        elif isinstance(prompt, (str, list)):
            prompts = [self.target.tokenize_mixed(prompt)]
        else:
            raise BadRequest('"prompt" must be a string, a list of tokens or a list of prompts')
        if any(not p for p in prompts):
            raise BadRequest("empty prompts are not emulated")
        if any(t < 0 or t >= self.target.n_vocab for p in prompts for t in p):
            raise BadRequest("Prompt contains invalid tokens")
        for p in prompts:
            if len(p) >= self.engine.n_ctx_slot:
                raise BadRequest(
                    f"request ({len(p)} tokens) exceeds the available context size "
                    f"({self.engine.n_ctx_slot} tokens), try increasing it"
                )
        return prompts

    @staticmethod
    def _check_greedy(body: dict[str, Any]) -> None:
        greedy = float(body.get("temperature", 0.8)) <= 0 or int(body.get("top_k", 40)) == 1
        if not greedy or int(body.get("n_probs", 0)) > 0:
            raise BadRequest("the regime server emulates greedy decoding only (temperature 0 "
                             "or top_k 1, no n_probs)")  # fmt: skip

    async def _charge_host(self, started: float, prompts: list[list[int]]) -> None:
        """The host's work on a request, less what this process already spent on it
        and what it will spend on the response."""
        charge = self.regime.host.request_ms(len(prompts), sum(len(p) for p in prompts))
        await WAKE_UP.until(started + (charge - self._after_ms) / 1e3)

    def _tasks(self, body: dict[str, Any], prompts: list[list[int]], on_token: Any) -> list[Task]:
        n_predict = int(body.get("n_predict", body.get("max_tokens", -1)))
        if n_predict < 0:
            n_predict = self.engine.n_ctx_slot
        if n_predict == 0:
            raise BadRequest("n_predict 0 is not emulated")
        return [
            Task(prompt=p, n_predict=n_predict, index=i, id_slot=int(body.get("id_slot", -1)),
                 cache_prompt=bool(body.get("cache_prompt", True)), on_token=on_token)
            for i, p in enumerate(prompts)
        ]  # fmt: skip

    def _final(self, task: Task, body: dict[str, Any]) -> dict[str, Any]:
        n_gen = len(task.generated)
        prompt_ms, predicted_ms = task.prompt_ms, max(task.predicted_ms, 0.001)
        content = "" if body.get("stream") else self.target.detokenize(task.generated)
        payload: dict[str, Any] = {
            "index": task.index,
            "content": content,
            "tokens": [] if body.get("stream") else list(task.generated),
            "id_slot": task.slot,
            "stop": True,
            "model": self.options.alias or self.options.model_path,
            "tokens_predicted": n_gen,
            "tokens_evaluated": len(task.prompt),
            "generation_settings": {
                "n_predict": task.n_predict,
                "temperature": float(body.get("temperature", 0.8)),
                "logit_bias": [{"token": t, "bias": False} for t in self.target.eog_ids]
                if body.get("ignore_eos")
                else [],
            },
            "prompt": "",
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": task.stop_type,
            "stopping_word": "",
            "tokens_cached": len(task.prompt) + max(n_gen - 1, 0),
            "timings": {
                "cache_n": task.n_cached,
                "prompt_n": task.n_prompt_processed,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(task.n_prompt_processed, 1),
                "prompt_per_second": 1e3 * task.n_prompt_processed / prompt_ms if prompt_ms else 0,
                "predicted_n": n_gen,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(n_gen - 1, 1) if n_gen > 1 else 0.0,
                "predicted_per_second": 1e3 * (n_gen - 1) / predicted_ms
                if predicted_ms and n_gen > 1
                else 0.0,
            },
        }
        if not body.get("return_tokens") and not body.get("stream"):
            payload["tokens"] = []
        return _pick(payload, body.get("response_fields"))

    async def completion(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await _json(request)
        if "prompt" not in body:
            raise BadRequest('"prompt" must be provided')
        if body["prompt"] in ([], ""):
            raise BadRequest('"prompt" must not be empty')
        self._check_greedy(body)
        prompts = self._prompts(body["prompt"])
        await self._charge_host(started, prompts)
        if body.get("stream"):
            return await self._stream_completion(request, body, prompts)
        tasks = self._tasks(body, prompts, None)
        await self._serve(request, tasks)
        done = time.perf_counter()
        errors = [t.error for t in tasks if t.error]
        if errors:
            return _error(500, errors[0], "server_error")
        results = [self._final(t, body) for t in tasks]
        response = web.json_response(results if len(results) > 1 else results[0])
        after = (time.perf_counter() - done) * 1e3
        self._after_ms += AFTER_WEIGHT * (after - self._after_ms)
        return response

    async def _serve(self, request: web.Request, tasks: list[Task]) -> None:
        """Queue the tasks and wait for them; a client that goes away cancels them."""
        self.engine.submit(tasks)
        try:
            await asyncio.gather(*(t.done for t in tasks))
        except asyncio.CancelledError:
            for task in tasks:
                self.engine.cancel(task)
            raise

    async def _stream_completion(
        self, request: web.Request, body: dict[str, Any], prompts: list[list[int]]
    ) -> web.StreamResponse:
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        def on_token(task: Task, token: int) -> None:
            chunk = {
                "index": task.index,
                "content": self.target.piece(token).decode("utf-8", errors="replace"),
                "tokens": [token],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": len(task.generated),
                "tokens_evaluated": len(task.prompt),
            }
            chunks.put_nowait(_sse(chunk))

        tasks = self._tasks(body, prompts, on_token)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.engine.submit(tasks)

        async def finish() -> None:
            for task in tasks:
                await task.done
                if task.error:
                    chunks.put_nowait(_sse({"error": {"code": 500, "message": task.error}}))
                else:
                    chunks.put_nowait(_sse(self._final(task, body)))
            chunks.put_nowait(None)

        return await self._pump(response, chunks, tasks, finish())

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI chat, greedy: the template, then one completion (no reasoning split)."""
        started = time.perf_counter()
        body = await _json(request)
        self._check_greedy(body)
        prompts = [self.target.tokenize(self._template(body))]
        await self._charge_host(started, prompts)
        created = int(time.time())
        model = self.options.alias or self.options.model_path
        base = {"id": f"chatcmpl-regime{created}", "created": created, "model": model}
        if not body.get("stream"):
            tasks = self._tasks(body, prompts, None)
            await self._serve(request, tasks)
            task = tasks[0]
            return web.json_response(
                {**base, "object": "chat.completion",
                 "choices": [{"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant",
                                          "content": self.target.detokenize(task.generated)}}],
                 "usage": _usage(task), "timings": self._final(task, {})["timings"]}
            )  # fmt: skip
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        def on_token(task: Task, token: int) -> None:
            text = self.target.piece(token).decode("utf-8", errors="replace")
            delta = {"role": "assistant", "content": None} if len(task.generated) == 1 else {}
            choice = {"index": 0, "finish_reason": None, "delta": {**delta, "content": text}}
            chunks.put_nowait(
                _sse({**base, "object": "chat.completion.chunk", "choices": [choice]})
            )

        tasks = self._tasks(body, prompts, on_token)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.engine.submit(tasks)

        async def finish() -> None:
            await tasks[0].done
            chunks.put_nowait(_sse({**base, "object": "chat.completion.chunk",
                                    "choices": [{"index": 0, "finish_reason": "length",
                                                 "delta": {}}],
                                    "usage": _usage(tasks[0])}))  # fmt: skip
            chunks.put_nowait(b"data: [DONE]\n\n")
            chunks.put_nowait(None)

        return await self._pump(response, chunks, tasks, finish())

    async def _pump(
        self,
        response: web.StreamResponse,
        chunks: asyncio.Queue[bytes | None],
        tasks: list[Task],
        finish: Any,
    ) -> web.StreamResponse:
        """Write the stream's chunks until `finish` ends it; a client that goes away
        cancels the tasks (the server frees their slots at its next batch)."""
        finisher = asyncio.create_task(finish)
        try:
            while (chunk := await chunks.get()) is not None:
                await response.write(chunk)
        except (asyncio.CancelledError, ConnectionResetError):
            for task in tasks:
                self.engine.cancel(task)
            finisher.cancel()
            raise
        await finisher
        await response.write_eof()
        return response


def _all_text(prompt: list[Any]) -> bool:
    """Several text prompts (one text alone is one prompt)."""
    return len(prompt) > 1 and all(isinstance(p, str) for p in prompt)


def _usage(task: Task) -> dict[str, int]:
    n = len(task.generated)
    return {"completion_tokens": n, "prompt_tokens": len(task.prompt),
            "total_tokens": n + len(task.prompt)}  # fmt: skip


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
