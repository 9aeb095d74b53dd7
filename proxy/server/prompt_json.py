"""The verify request body, encoded without re-encoding the context every round.

A verify body repeats the whole context in each of its k+1 prompts, and json.dumps
of k+1 prompts of a long context costs more Python per round than the proxy's whole
overhead budget (docs/BENCHMARKS.md, "Measurements behind design choices"). The
context only grows by a few tokens a round, so its
JSON text is kept and extended, and the body is assembled from that text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def ids_text(tokens: Sequence[int]) -> str:
    """JSON text of a list of token ids, without the brackets."""
    return ",".join(map(str, tokens))


class ContextTextCache:
    """JSON text of recent contexts (most recent first), extended when a new context
    starts with a cached one: one entry per conversation in flight."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: list[tuple[list[int], str]] = []

    def text(self, context: list[int]) -> str:
        """`context` is kept as is (not copied): the caller must not change it later."""
        for i, (tokens, text) in enumerate(self._entries):
            n = len(tokens)
            if n <= len(context) and context[:n] == tokens:
                if len(context) > n:
                    text = f"{text},{ids_text(context[n:])}" if text else ids_text(context)
                del self._entries[i]
                break
        else:
            text = ids_text(context)
        self._entries.insert(0, (context, text))
        del self._entries[self.size :]
        return text


def verify_body_text(
    context_text: str, draft: Sequence[int], params: dict[str, Any], pad: Sequence[int] = ()
) -> str:
    """`{"prompt": [ctx, ctx+d1, ..., ctx+d1..dk(, pad)], **params}` as JSON text: `pad`,
    where given, is one more prompt of its own (`proxy.engine.round_shape`)."""
    prompts = []
    for suffix_ids in (draft[:i] for i in range(len(draft) + 1)):
        suffix = ids_text(suffix_ids)
        joined = f"{context_text},{suffix}" if context_text and suffix else context_text or suffix
        prompts.append(f"[{joined}]")
    if pad:
        prompts.append(f"[{ids_text(pad)}]")
    rest = json.dumps(params)
    return '{"prompt":[' + ",".join(prompts) + "]" + ("," + rest[1:] if len(rest) > 2 else "}")
