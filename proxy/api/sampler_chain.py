"""The request's effective sampler chain, read as llama.cpp b11434 reads it, and what
each stage does to the token distribution at the values in force.

Sources: common/sampling.cpp (common_sampler_types_from_names / _from_chars, the
chain built in common_sampler_init), src/llama-sampler.cpp (each stage's no-op
conditions), common/common.h (the default chain).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

# llama.cpp's default chain (common_params_sampling::samplers).
DEFAULT_SAMPLERS = [
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
]  # fmt: skip

_CANONICAL = {
    "dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill",
    "penalties", "adaptive_p",
}  # fmt: skip
# common_sampler_types_from_names: kebab-case and no-underscore spellings, and misc aliases
_ALIASES = {
    **{name.replace("_", "-"): name for name in _CANONICAL if "_" in name},
    **{name.replace("_", ""): name for name in _CANONICAL if "_" in name},
    "nucleus": "top_p",
    "temp": "temperature",
    "typ": "typ_p",
}
# common_sampler_type_to_chr
_CHARS = {
    "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
    "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p",
}  # fmt: skip


class ChainError(ValueError):
    """The samplers field is not something the server reads as a chain."""


def parse_samplers(value: Any) -> list[str]:
    """The chain the server builds from a `samplers` field: names (case-insensitive,
    aliases allowed) or a string of letters; what it cannot match it drops with a
    warning, exactly as the server does."""
    if isinstance(value, str):
        return [_CHARS[c] for c in value if c in _CHARS]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        known = {**_ALIASES, **{name: name for name in _CANONICAL}}
        return [known[x.lower()] for x in value if x.lower() in known]
    # the server's handler ignores other JSON types, but json.get<vector<string>> on
    # a mixed array throws: either way the server answers, not us
    raise ChainError("samplers is neither a list of names nor a string of letters")


class Effect(Enum):
    NEUTRAL = "neutral"  # a no-op at these values
    KEEPS_ARGMAX = "keeps-argmax"  # may drop tokens but never the most likely one
    ARGMAX = "argmax"  # leaves only the most likely token (greedy)
    MIRRORED = "mirrored"  # reshapes the distribution the way the verify batch does
    CHANGES = "changes"  # reshapes it in a way the engine does not mirror


def _num(value: Any, default: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default


def stage_effect(stage: str, get: Callable[[str], Any]) -> Effect:
    """What one stage does at the effective values (`get(key)`: request, else the
    server's default; None when neither says)."""
    if stage == "penalties":  # llama_sampler_penalties_apply returns early on these
        neutral = (
            _num(get("repeat_penalty"), 1.0) == 1.0
            and _num(get("frequency_penalty"), 0.0) == 0.0
            and _num(get("presence_penalty"), 0.0) == 0.0
        ) or _num(get("repeat_last_n"), 64) == 0
        return Effect.NEUTRAL if neutral else Effect.CHANGES
    if stage == "dry":  # llama_sampler_dry_apply: multiplier 0 or penalty_last_n 0
        neutral = (
            _num(get("dry_multiplier"), 0.0) == 0.0 or _num(get("dry_penalty_last_n"), -1) == 0
        )
        return Effect.NEUTRAL if neutral else Effect.CHANGES
    if stage == "top_n_sigma":  # <= 0 disables; otherwise keeps the top logit's band
        return Effect.NEUTRAL if _num(get("top_n_sigma"), -1.0) <= 0.0 else Effect.KEEPS_ARGMAX
    if stage == "top_k":  # k <= 0 disables; k >= 1 always keeps the top token
        k = _num(get("top_k"), 40)
        if k <= 0:
            return Effect.NEUTRAL
        return Effect.ARGMAX if k == 1 else Effect.MIRRORED
    if stage == "typ_p":  # locally typical sampling can drop the most likely token
        return Effect.NEUTRAL if _num(get("typical_p"), 1.0) >= 1.0 else Effect.CHANGES
    if stage == "top_p":
        return Effect.NEUTRAL if _num(get("top_p"), 0.95) >= 1.0 else Effect.MIRRORED
    if stage == "min_p":
        return Effect.NEUTRAL if _num(get("min_p"), 0.05) <= 0.0 else Effect.MIRRORED
    if stage == "xtc":  # XTC removes the top tokens; off at p <= 0 or threshold > 0.5
        off = _num(get("xtc_probability"), 0.0) <= 0.0 or _num(get("xtc_threshold"), 0.1) > 0.5
        return Effect.NEUTRAL if off else Effect.CHANGES
    if stage == "temperature":
        if _num(get("dynatemp_range"), 0.0) > 0.0:  # entropy-driven temperature
            return Effect.CHANGES
        return Effect.ARGMAX if _num(get("temperature"), 0.8) <= 0.0 else Effect.MIRRORED
    return Effect.CHANGES  # infill, adaptive_p (replaces the final draw)


# Stages whose KEEPS_ARGMAX/MIRRORED effect the sampling-mode verify batch reproduces,
# in its order (proxy.server.upstream.SAMPLING_CHAIN).
MIRRORED_ORDER = ["top_k", "top_p", "min_p", "temperature"]
