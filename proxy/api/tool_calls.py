"""Chat requests that offer tools: speculative until the model starts a tool call.

With tools offered (tool_choice auto), llama-server arms a *lazy* grammar: nothing
constrains the output until a trigger appears in it (for Qwen-style templates the word
"<tool_call>\\n"), so up to and including the token that completes the trigger, the
tokens are those of the same request without tools. The proxy asks the server once per
tool set which triggers it arms (a one-token request with `verbose`, whose
generation_settings list them), lets the engine stop where a trigger appears, and then
hands the request to the server, which writes the tool call itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from proxy.api.requests import NotEligible
from proxy.server.upstream import UpstreamClient, UpstreamClientError, UpstreamError

TRIGGER_WORD = 1  # common_grammar_trigger_type: TOKEN, WORD, PATTERN, PATTERN_FULL
MAX_TOOL_SETS = 64  # tool sets remembered; the oldest is asked again when it returns


class ToolTriggers:
    """The trigger words the server arms for a tool set, asked once per set."""

    def __init__(self, upstream: UpstreamClient) -> None:
        self.upstream = upstream
        self._known: dict[str, list[str] | str] = {}  # words, or why not speculative

    async def words(self, body: dict[str, Any]) -> list[str]:
        """The words, or NotEligible when the server arms something the engine cannot
        watch for (token or pattern triggers, or special tokens it renders)."""
        fields = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
        probe = {k: body[k] for k in fields if k in body}
        key = json.dumps(probe, sort_keys=True)
        if key not in self._known:
            if len(self._known) >= MAX_TOOL_SETS:
                del self._known[next(iter(self._known))]
            self._known[key] = await self._ask(probe)
        known = self._known[key]
        if isinstance(known, str):
            raise NotEligible(known)
        return known

    async def _ask(self, probe: dict[str, Any]) -> list[str] | str:
        request = {
            **probe,
            "messages": [{"role": "user", "content": "?"}],
            "max_tokens": 1,
            "temperature": 0,
            "cache_prompt": False,
            "verbose": True,
        }
        try:
            # the server's own chat route: the only one that builds the tool grammar
            payload = await self.upstream._request_json("POST", "/v1/chat/completions", request)
        except UpstreamClientError as exc:
            return f"the server refuses these tools: {exc}"
        settings = (payload.get("__verbose") or {}).get("generation_settings") or {}
        if "grammar_triggers" not in settings:
            return "the server did not report its tool-call triggers"
        if settings.get("preserved_tokens"):
            # the server then writes those special tokens into the text; the engine does not
            return "the tool-call format uses special tokens"
        if not settings.get("grammar_lazy", False) and settings.get("grammar"):
            return "the tool grammar constrains the whole answer"
        triggers = settings["grammar_triggers"]
        if any(t.get("type") != TRIGGER_WORD or not t.get("value") for t in triggers):
            return f"tool-call triggers other than words: {triggers}"
        return [t["value"] for t in triggers]


def fallback_events(
    events: list[dict[str, Any]] | None,
    sent_content: str,
    sent_reasoning: str,
    sent_role: bool,
) -> list[dict[str, Any]]:
    """The server's stream for the same request, less what the proxy already sent.

    The server's text before the tool call is the proxy's (the same tokens), so its
    deltas are dropped until they reach past what was sent; the rest (the tool call,
    the final chunks) goes on as the server wrote it.
    """
    out: list[dict[str, Any]] = []
    content = reasoning = ""
    for event in events or []:
        if "prompt_progress" in event:
            continue
        choices = event.get("choices") or []
        if not choices:  # the usage chunk
            out.append(event)
            continue
        delta = dict(choices[0].get("delta") or {})
        if sent_role and delta.get("role") and not delta.get("content") and not out:
            continue  # the opening role chunk, already sent
        new_content = content + (delta.get("content") or "")
        new_reasoning = reasoning + (delta.get("reasoning_content") or "")
        for key, before, after, sent in (
            ("content", content, new_content, sent_content),
            ("reasoning_content", reasoning, new_reasoning, sent_reasoning),
        ):
            if delta.get(key):
                # keep only the part beyond what the proxy already sent
                unsent = after[max(len(sent), len(before)) :]
                if unsent:
                    delta[key] = unsent
                else:
                    del delta[key]
        content, reasoning = new_content, new_reasoning
        finish = choices[0].get("finish_reason")
        if delta or finish is not None or "timings" in event:
            out.append({**event, "choices": [{**choices[0], "delta": delta}]})
    return out


async def server_stream(
    upstream: UpstreamClient, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The server's SSE events for a streaming chat request."""
    response = await upstream.request(
        "POST", "/v1/chat/completions", data=json.dumps(body).encode(),
        # llama-server closes a connection after a stream: never reuse this one
        headers={"Content-Type": "application/json", "Connection": "close"},
    )  # fmt: skip
    async with response:
        if response.status != 200:
            raise UpstreamError(
                upstream.base_url, f"the tool call's stream failed (HTTP {response.status})"
            )
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                block = block.strip()
                if block.startswith(b"data: ") and block != b"data: [DONE]":
                    yield json.loads(block[len(b"data: ") :])
