"""What every response format shares, shaped exactly like llama-server's
(tools/server/server-task.cpp): the request's context, `generation_settings`, usage,
timings, and the chat output parsed as the server's chat parser reads it. The formats
themselves are in proxy.api.formats.

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


# -- chat messages, parsed as the server's chat parser reads the output ---------------


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


def chat_diff(before: ChatMessage, after: ChatMessage) -> dict[str, Any] | None:
    """The delta between two parses of the growing message (server_chat_msg_diff)."""
    delta: dict[str, Any] = {}
    if after.reasoning_content != before.reasoning_content:
        delta["reasoning_content"] = after.reasoning_content[len(before.reasoning_content) :]
    if after.content != before.content:
        delta["content"] = after.content[len(before.content) :]
    return delta or None
