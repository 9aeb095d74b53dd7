"""What the server answers the engine: a verify batch's results and a plain run.

Shared by the client that parses them (`proxy.server.upstream`) and the engine that
judges them, so neither imports the other for its data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyResult:
    """The target's greedy next token after one prompt of the verify batch."""

    token: int
    piece: str  # the token's text as the server appends it (U+FFFD where UTF-8 is partial)
    is_eog: bool  # the server stopped with stop_type "eos": an end-of-generation token
    cached: int = 0  # prompt tokens the slot reused from its cache (timings.cache_n)
    id_slot: int = -1  # the slot that served this prompt
    prompt_n: int = 0  # prompt tokens the slot ingested for it (timings.prompt_n)
    server_ms: float = 0.0  # the slot's prompt_ms + predicted_ms: its time inside the server
    # sampling verify only: (id, exact bytes, probability) of every candidate left after
    # the chain, best first; None when the server sent none (partial UTF-8 token)
    candidates: tuple[tuple[int, bytes, float], ...] | None = None


@dataclass(frozen=True)
class PlainRun:
    """Greedy tokens the server decoded itself after one context (a plain run)."""

    tokens: list[int]
    content: str  # the server's text of the run (control tokens render as nothing)
    stop_type: str  # "eos", "limit", ... as the server reports it
    cached: int = 0  # context tokens the slot reused from its cache
    id_slot: int = -1  # the slot that now holds the context and the run's tokens
    server_ms: float = 0.0  # the slot's prompt_ms + predicted_ms: its time inside the server
