"""The response format of each speculative endpoint, rendered by its own class.

Like the result types of llama.cpp's server (tools/server/server-task.cpp), each
format writes its own JSON: the whole body, the stream's token chunks and its end.
The route picks the format once; one instance serves one request. Key order follows
the server's (its JSON objects keep insertion order).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from proxy.api.shapes import (
    ChatMessage,
    ResponseContext,
    chat_diff,
    finish_reason,
    parse_chat_output,
    text,
    thinking_prefix,
    usage,
)
from proxy.api.tool_calls import fallback_events
from proxy.engine import GenerationResult
from proxy.engine.server_text import TokenEvent

Chunk = dict[str, Any]


class ResponseFormat(ABC):
    """How one request's generation is answered, whole or streamed."""

    ends_with_done = True  # the stream's last event is `data: [DONE]`

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def body(self, result: GenerationResult) -> Chunk:
        """The whole answer of a request that did not stream."""

    @abstractmethod
    def token_chunks(self, event: TokenEvent, timings: dict | None) -> list[Chunk]:
        """The stream chunks of one generated token (`timings` on the last)."""

    @abstractmethod
    def end_chunks(self, result: GenerationResult) -> list[Chunk]:
        """The chunks that end a stream, before any [DONE]."""

    @abstractmethod
    def _no_token_chunk(self) -> Chunk:
        """The server's partial result for no token (send_partial_response(slot, {},
        true): token 0, no text)."""

    def progress_chunk(self, progress: dict[str, Any]) -> Chunk:
        """A `return_progress` event: the partial result for no token, with
        `prompt_progress`."""
        out = self._no_token_chunk()
        out["prompt_progress"] = progress
        return out

    def tool_call_chunks(self, server_events: list[Chunk]) -> list[Chunk]:
        """The rest of a stream whose model started a tool call, from the server's
        own stream. Only chat requests offer tools: no other generation stops there."""
        raise NotImplementedError(f"{type(self).__name__} offers no tool calls")


class _FinalObjectFormat(ResponseFormat):
    """A format whose whole body and whose stream's end are the same final object."""

    def body(self, result: GenerationResult) -> Chunk:
        return self._final(result, stream=False)

    def end_chunks(self, result: GenerationResult) -> list[Chunk]:
        return [self._final(result, stream=True)]

    @abstractmethod
    def _final(self, result: GenerationResult, stream: bool) -> Chunk:
        """The final object; streamed, without what the token chunks already sent."""


class NativeCompletion(_FinalObjectFormat):
    """`/completion`: llama.cpp's native format."""

    ends_with_done = False

    def token_chunks(self, event: TokenEvent, timings: dict | None) -> list[Chunk]:
        out: Chunk = {
            "index": 0,
            "content": text(event.text),
            "tokens": [event.token],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": event.n_decoded,
            "tokens_evaluated": self.ctx.n_prompt,
        }
        if timings is not None:
            out["timings"] = timings
        return [out]

    def _no_token_chunk(self) -> Chunk:
        return {
            "index": 0, "content": "", "tokens": [0], "stop": False, "id_slot": -1,
            "tokens_predicted": 0, "tokens_evaluated": self.ctx.n_prompt,
        }  # fmt: skip

    def _final(self, result: GenerationResult, stream: bool) -> Chunk:
        ctx = self.ctx
        return {
            "index": 0,
            "content": "" if stream else text(result.content),
            "tokens": list(result.tokens) if ctx.return_tokens and not stream else [],
            "id_slot": 0,
            "stop": True,
            "model": ctx.model,
            "tokens_predicted": len(result.tokens),
            "tokens_evaluated": ctx.n_prompt,
            "generation_settings": ctx.generation_settings,
            "prompt": ctx.prompt_text,
            "has_new_line": result.has_new_line,
            "truncated": result.truncated,
            "stop_type": result.stop_type,
            "stopping_word": result.stopping_word,
            "tokens_cached": ctx.n_prompt + max(len(result.tokens) - 1, 0),
            "timings": result.timings(),
        }


class OaiCompletion(_FinalObjectFormat):
    """`/v1/completions`: OpenAI's text completion."""

    def token_chunks(self, event: TokenEvent, timings: dict | None) -> list[Chunk]:
        out = self._partial(text(event.text))
        if timings is not None:
            out["timings"] = timings
        return [out]

    def _no_token_chunk(self) -> Chunk:
        return self._partial("")

    def _partial(self, piece: str) -> Chunk:
        ctx = self.ctx
        return {
            "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
            "created": ctx.created,
            "model": ctx.model,
            "system_fingerprint": ctx.build_info,
            "object": "text_completion",
            "id": ctx.cmpl_id,
        }

    def _final(self, result: GenerationResult, stream: bool) -> Chunk:
        ctx = self.ctx
        return {
            "choices": [
                {
                    "text": "" if stream else text(result.content),
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason(result.stop_type),
                }
            ],
            "created": ctx.created,
            "model": ctx.model,
            "system_fingerprint": ctx.build_info,
            "object": "text_completion",
            "usage": usage(ctx, result),
            "id": ctx.cmpl_id,
            "timings": result.timings(),
        }


class ChatCompletion(ResponseFormat):
    """`/v1/chat/completions`: OpenAI's chat completion. Streamed, it parses the
    growing message as the server's chat parser does and sends the differences."""

    def __init__(self, ctx: ResponseContext) -> None:
        super().__init__(ctx)
        self.prefix = thinking_prefix(ctx.prompt_text)
        self.text = ""  # generated so far
        self.message = ChatMessage(content="")  # its parse, as sent
        self.role_sent = False  # the opening {"role": "assistant"} chunk

    def body(self, result: GenerationResult) -> Chunk:
        ctx = self.ctx
        message = parse_chat_output(text(result.content), self.prefix, ctx.reasoning_format)
        return {
            "choices": [
                {
                    "finish_reason": finish_reason(result.stop_type),
                    "index": 0,
                    "message": _message_json(message),
                }
            ],
            "created": ctx.created,
            "model": ctx.model,
            "system_fingerprint": ctx.build_info,
            "object": "chat.completion",
            "usage": usage(ctx, result),
            "id": ctx.cmpl_id,
            "timings": result.timings(),
        }

    def token_chunks(self, event: TokenEvent, timings: dict | None) -> list[Chunk]:
        chunks = []
        if event.n_decoded == 1:
            chunks.append(self._no_token_chunk())
            self.role_sent = True
        diff = self._update(text(event.text))
        if diff:
            chunks.append(self._chunk(diff))
        if chunks and timings is not None:
            chunks[-1]["timings"] = timings
        return chunks

    def end_chunks(self, result: GenerationResult) -> list[Chunk]:
        chunks = []
        last_diff = self._update("")
        if last_diff:
            chunks.append(self._chunk(last_diff))
        chunks.append(self._chunk({}, finish_reason(result.stop_type)))
        if self.ctx.include_usage:
            usage_chunk = self._chunk({})
            usage_chunk["choices"] = []
            usage_chunk["usage"] = usage(self.ctx, result)
            chunks.append(usage_chunk)
        chunks[-1]["timings"] = result.timings()
        return chunks

    def tool_call_chunks(self, server_events: list[Chunk]) -> list[Chunk]:
        # the text so far is the server's; it writes the tool call and the end
        sent = self.message
        chunks = fallback_events(
            server_events, sent.content, sent.reasoning_content, self.role_sent
        )
        for chunk in chunks:
            chunk.update({"id": self.ctx.cmpl_id, "created": self.ctx.created})
        return chunks

    def _no_token_chunk(self) -> Chunk:
        return self._chunk({"role": "assistant", "content": None})

    def _update(self, added: str) -> dict[str, Any] | None:
        """The delta the new text makes to the parsed message (server_chat_msg_diff)."""
        self.text += added
        parsed = parse_chat_output(self.text, self.prefix, self.ctx.reasoning_format)
        diff = chat_diff(self.message, parsed)
        self.message = parsed
        return diff

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Chunk:
        ctx = self.ctx
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": ctx.created,
            "id": ctx.cmpl_id,
            "model": ctx.model,
            "system_fingerprint": ctx.build_info,
            "object": "chat.completion.chunk",
        }


def _message_json(message: ChatMessage) -> Chunk:
    out: Chunk = {"role": "assistant", "content": message.content}
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out
