"""Response bodies shaped exactly like llama-server's (tools/server/server-task.cpp).

Key order follows the server's (its JSON objects keep insertion order).
"""

from __future__ import annotations

import json
import random
import string
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.engine import GenerationResult
from proxy.server_text import TokenEvent


def dumps(obj: Any) -> str:
    """Compact JSON with raw UTF-8, like the server's `safe_json_to_str`."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


def text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def random_id(prefix: str = "chatcmpl-") -> str:
    alphabet = string.digits + string.ascii_uppercase + string.ascii_lowercase
    return prefix + "".join(random.choices(alphabet, k=32))


def finish_reason(stop_type: str) -> str:
    return "stop" if stop_type in ("word", "eos") else "length"


@dataclass
class ResponseContext:
    model: str
    build_info: str
    n_prompt: int
    prompt_text: str
    generation_settings: dict[str, Any]
    include_usage: bool = False
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    reasoning_format: str = "auto"
    cmpl_id: str = field(default_factory=random_id)
    created: int = field(default_factory=lambda: int(time.time()))


def generation_settings(template: dict[str, Any], body: dict[str, Any], n_predict: int,
                        stop: list[str], stream: bool) -> dict[str, Any]:  # fmt: skip
    """The server's `generation_settings` for this request.

    `template` is what the server reported for a default greedy request at start-up;
    the request's own values are laid over it, numbers coerced to the template's type
    (the server stores temperature as a float even when the client sent 0).
    """
    settings = dict(template)
    for key, value in body.items():
        if key not in settings or key in ("n_predict", "max_tokens", "stream", "stop"):
            continue
        if isinstance(settings[key], float) and isinstance(value, int | float):
            value = float(value)
        settings[key] = value
    settings["n_predict"] = n_predict
    settings["max_tokens"] = n_predict
    settings["stream"] = stream
    if "stop" in settings:
        settings["stop"] = list(stop)
    return settings


def usage(ctx: ResponseContext, result: GenerationResult) -> dict[str, Any]:
    n = len(result.tokens)
    return {
        "completion_tokens": n,
        "prompt_tokens": ctx.n_prompt,
        "total_tokens": n + ctx.n_prompt,
        "prompt_tokens_details": {"cached_tokens": result.n_prompt_cached},
    }


def running_timings(n_prompt: int, n_decoded: int, prompt_ms: float,
                    predicted_ms: float) -> dict[str, float | int]:  # fmt: skip
    """The `timings` of a streamed chunk under `timings_per_token`, before the end.

    Same keys as the server's (server_slot_stats::to_json). The engine learns how much
    of the prompt the server had cached only at the end, so running chunks count the
    whole prompt as processed; the last chunk carries the exact figures.
    """
    steps = max(n_decoded - 1, 0)
    return {
        "cache_n": 0,
        "prompt_n": n_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt > 0 else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * n_prompt if prompt_ms > 0 else 0.0,
        "predicted_n": n_decoded,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
    }


def prompt_progress(n_prompt: int, processed: int, time_ms: float) -> dict[str, Any]:
    """result_prompt_progress::to_json."""
    return {"total": n_prompt, "cache": 0, "processed": processed, "time_ms": int(time_ms)}


def progress_chunk(ctx: ResponseContext, kind: str, progress: dict[str, Any]) -> dict[str, Any]:
    """A `return_progress` event: the server's partial result for no token
    (send_partial_response(slot, {}, true): token 0, no text) with `prompt_progress`."""
    if kind == "native":
        out: dict[str, Any] = {
            "index": 0, "content": "", "tokens": [0], "stop": False, "id_slot": -1,
            "tokens_predicted": 0, "tokens_evaluated": ctx.n_prompt,
        }  # fmt: skip
    elif kind == "oai":
        out = oai_completion_partial(ctx, TokenEvent(token=0, text=b"", sent=True, n_decoded=0))
    else:
        out = chat_chunk(ctx, {"role": "assistant", "content": None})
    out["prompt_progress"] = progress
    return out


# -- /completion (llama.cpp native) ------------------------------------------------


def native_partial(
    ctx: ResponseContext, event: TokenEvent, timings: dict | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": 0,
        "content": text(event.text),
        "tokens": [event.token],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": event.n_decoded,
        "tokens_evaluated": ctx.n_prompt,
    }
    if timings is not None:
        out["timings"] = timings
    return out


def native_final(
    ctx: ResponseContext, result: GenerationResult, stream: bool, return_tokens: bool
) -> dict[str, Any]:
    return {
        "index": 0,
        "content": "" if stream else text(result.content),
        "tokens": list(result.tokens) if return_tokens and not stream else [],
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


# -- /v1/completions -------------------------------------------------------------


def oai_completion_partial(ctx: ResponseContext, event: TokenEvent,
                           timings: dict | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {
        "choices": [
            {"text": text(event.text), "index": 0, "logprobs": None, "finish_reason": None}
        ],
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.build_info,
        "object": "text_completion",
        "id": ctx.cmpl_id,
    }
    if timings is not None:
        out["timings"] = timings
    return out


def oai_completion_final(ctx: ResponseContext, result: GenerationResult,
                         stream: bool) -> dict[str, Any]:  # fmt: skip
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


# -- /v1/chat/completions ---------------------------------------------------------


@dataclass
class ChatMessage:
    content: str
    reasoning_content: str = ""


def thinking_prefix(prompt_text: str, start: str = "<think>") -> str:
    """The part of the generation prompt the server's chat parser reads together with
    the output: an opened (or pre-closed) thinking block after the last turn marker."""
    index = prompt_text.rfind(start)
    if index < 0 or "<|im_start|>" in prompt_text[index:]:
        return ""
    return prompt_text[index:]


def parse_chat_output(generated: str, prefix: str, reasoning_format: str) -> ChatMessage:
    """The message the server's chat parser makes of the output so far.

    reasoning_format "none" keeps the text as generated, after what the generation
    prompt opened (e.g. "<think>\n") and without leading whitespace; "auto" and
    "deepseek" split a leading thinking block into reasoning_content.
    """
    if reasoning_format == "none":
        return ChatMessage(content=(prefix + generated).lstrip())
    return split_reasoning(generated, prefix)


def split_reasoning(
    generated: str, prefix: str = "", start: str = "<think>", end: str = "</think>"
) -> ChatMessage:
    """The server's chat parse for templates with <think> reasoning (Qwen3).

    Mirrors the auto-generated PEG parser (common/chat-auto-parser-generator.cpp):
    whitespace after the generation prompt is skipped, an optional leading
    `<think>...</think>` block becomes reasoning_content (dropped when only
    whitespace), whitespace after `</think>` is skipped, the rest is content.
    """
    text = (prefix + generated).lstrip()
    if not text.startswith(start):
        return ChatMessage(content=text)
    body = text[len(start) :]
    cut = body.find(end)
    if cut < 0:
        reasoning, content = body, ""
    else:
        reasoning, content = body[:cut], body[cut + len(end) :].lstrip()
    if not reasoning.strip():
        reasoning = ""
    return ChatMessage(content=content, reasoning_content=reasoning)


def chat_message_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def chat_final(ctx: ResponseContext, result: GenerationResult,
               message: ChatMessage) -> dict[str, Any]:  # fmt: skip
    return {
        "choices": [
            {
                "finish_reason": finish_reason(result.stop_type),
                "index": 0,
                "message": chat_message_json(message),
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


def chat_chunk(ctx: ResponseContext, delta: dict[str, Any],
               finish: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": ctx.created,
        "id": ctx.cmpl_id,
        "model": ctx.model,
        "system_fingerprint": ctx.build_info,
        "object": "chat.completion.chunk",
    }


def chat_diff(before: ChatMessage, after: ChatMessage) -> dict[str, Any] | None:
    """The delta between two parses of the growing message (server_chat_msg_diff)."""
    delta: dict[str, Any] = {}
    if after.reasoning_content != before.reasoning_content:
        delta["reasoning_content"] = after.reasoning_content[len(before.reasoning_content) :]
    if after.content != before.content:
        delta["content"] = after.content[len(before.content) :]
    return delta or None


def chat_final_chunks(ctx: ResponseContext, result: GenerationResult,
                      last_diff: dict[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
    chunks = []
    if last_diff:
        chunks.append(chat_chunk(ctx, last_diff))
    chunks.append(chat_chunk(ctx, {}, finish_reason(result.stop_type)))
    if ctx.include_usage:
        usage_chunk = chat_chunk(ctx, {})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = usage(ctx, result)
        chunks.append(usage_chunk)
    chunks[-1]["timings"] = result.timings()
    return chunks
