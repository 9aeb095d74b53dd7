"""Regime files: what one machine charges for each thing llama-server does.

A regime file is TOML (`regimes/NAME.toml` beside this module, or any path). Every
table carries a `source` saying where its numbers come from; numbers nobody measured
are listed under `assumptions`. The charges:

- `[decode]`: one llama_decode of n tokens (at most one micro-batch, `ubatch`) that
  attends over n_kv KV cells costs `fixed_ms(n) + per_kcell_ms(n) * n_kv / 1000`.
  Both are piecewise linear in n between the listed `tokens` (beyond the last
  point: the last segment's slope). n_kv is the unified pool's span (see kv_pool).
  Optionally `new_shape_ms`: what a decode costs more when its shape (tokens, outputs,
  span) is not that of the two decodes before it. llama.cpp reuses its compute graph
  for a decode of the last one's shape, and ggml's CUDA backend replays a CUDA graph
  only from the third decode of one shape in a row; the rows above are measured on
  repeated shapes.
- `[host]`: work outside the decodes. Per HTTP request, per prompt in it and per
  thousand prompt token ids (parsing and checking them), charged before the request's
  tasks reach the slots; per slot beyond the first that samples after one decode.
- `[slots]`: slot save and restore per thousand tokens, and a fixed cost per action;
  optionally per thousand cells of the pool's span beyond the slot's own.
- `[reference]`: measured rows of the real machine for reports (tok/s), with sources.
"""

from __future__ import annotations

import bisect
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGIMES_DIR = Path(__file__).resolve().parent / "regimes"


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys); the end segments extend beyond the ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class DecodeCost:
    tokens: tuple[int, ...]
    fixed_ms: tuple[float, ...]
    per_kcell_ms: tuple[float, ...]
    ubatch: int = 512
    new_shape_ms: float = 0.0  # a decode of another shape than the two before it

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0 or len(self.fixed_ms) != n or len(self.per_kcell_ms) != n:
            raise ValueError("[decode] tokens, fixed_ms and per_kcell_ms need one value each")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError("[decode] tokens must rise strictly from 1 or more")

    def ms(self, n_tokens: int, n_kv: int) -> float:
        """One decode of `n_tokens` (<= ubatch) attending over `n_kv` cells."""
        fixed = _interpolate(self.tokens, self.fixed_ms, n_tokens)
        per_kcell = _interpolate(self.tokens, self.per_kcell_ms, n_tokens)
        return max(0.0, fixed + per_kcell * n_kv / 1000.0)


@dataclass(frozen=True)
class HostCost:
    per_request_ms: float = 0.0
    per_prompt_ms: float = 0.0
    per_kid_ms: float = 0.0  # per 1000 prompt token ids in a request
    # per slot beyond the first that samples after the same decode (its output row and
    # sampling: what a k+1-prompt round costs beyond a one-slot batch of its tokens)
    per_extra_sample_ms: float = 0.0
    # the server thread's own work per thousand prompt tokens of a task when it starts
    # (prompt checks, cache comparison), charged before the batch that takes it
    server_per_ktoken_ms: float = 0.0

    def request_ms(self, n_prompts: int, n_ids: int) -> float:
        return self.per_request_ms + self.per_prompt_ms * n_prompts + self.per_kid_ms * n_ids / 1e3


@dataclass(frozen=True)
class SlotCost:
    action_ms: float = 0.0
    save_ms_per_ktoken: float = 0.0
    restore_ms_per_ktoken: float = 0.0
    # what a save or restore costs per thousand cells of the pool's span beyond the
    # slot's own (with unified KV the action works over the whole pool)
    save_ms_per_span_kcell: float = 0.0
    restore_ms_per_span_kcell: float = 0.0
    # llama-server's copy of a slot's prompt into its RAM prompt cache (a plain server's
    # new conversation pays it); None: charged as a slot save
    prompt_cache_save_ms_per_ktoken: float | None = None

    def save_ms(self, n_tokens: int, span: int = 0) -> float:
        return self._ms(self.save_ms_per_ktoken, self.save_ms_per_span_kcell, n_tokens, span)

    def restore_ms(self, n_tokens: int, span: int = 0) -> float:
        return self._ms(self.restore_ms_per_ktoken, self.restore_ms_per_span_kcell, n_tokens, span)

    def _ms(self, per_ktoken: float, per_span_kcell: float, n_tokens: int, span: int) -> float:
        """One action on a slot of `n_tokens` in a pool spanning `span` cells."""
        extra = max(0, span - n_tokens) * per_span_kcell
        return self.action_ms + (per_ktoken * n_tokens + extra) / 1e3


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    decode: DecodeCost
    host: HostCost
    slots: SlotCost
    plain_step_ms: float | None = None  # the measured plain step the file stands for
    reference: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()
    path: Path | None = None

    def step_ms(self, context: int) -> float:
        """One plain decoding step at `context` tokens in one slot (its own cells only)."""
        return self.decode.ms(1, context)


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ValueError(f"[{name}] must be a table")
    return table


def _floats(table: dict[str, Any], key: str) -> tuple[float, ...]:
    return tuple(float(x) for x in table.get(key, ()))


def parse_regime(data: dict[str, Any], path: Path | None = None) -> Regime:
    decode = _table(data, "decode")
    host = _table(data, "host")
    slots = _table(data, "slots")
    sources = {
        name: str(_table(data, name)["source"])
        for name in ("decode", "host", "slots", "reference")
        if "source" in _table(data, name)
    }
    missing = [name for name in ("decode", "host", "slots") if name not in sources]
    if missing:
        raise ValueError(f"regime {path or data.get('name')}: no source for {missing}")
    reference = {k: v for k, v in _table(data, "reference").items() if k != "source"}
    return Regime(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        decode=DecodeCost(
            tokens=tuple(int(x) for x in decode["tokens"]),
            fixed_ms=_floats(decode, "fixed_ms"),
            per_kcell_ms=_floats(decode, "per_kcell_ms"),
            ubatch=int(decode.get("ubatch", 512)),
            new_shape_ms=float(decode.get("new_shape_ms", 0.0)),
        ),
        host=HostCost(**{k: float(v) for k, v in host.items() if k != "source"}),
        slots=SlotCost(**{k: float(v) for k, v in slots.items() if k != "source"}),
        plain_step_ms=float(data["plain_step_ms"]) if "plain_step_ms" in data else None,
        reference=reference,
        sources=sources,
        assumptions=tuple(str(a) for a in data.get("assumptions", ())),
        path=path,
    )


def regime_path(name_or_path: str | Path) -> Path:
    """A regime by file path, or by name from the shipped regimes folder."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return path
    shipped = REGIMES_DIR / f"{name_or_path}.toml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in REGIMES_DIR.glob("*.toml"))) or "none"
    raise FileNotFoundError(f"no regime {str(name_or_path)!r} (a .toml path, or one of: {known})")


def load_regime(name_or_path: str | Path) -> Regime:
    path = regime_path(name_or_path)
    return parse_regime(tomllib.loads(path.read_text()), path)
