"""Speculate under load, or let llama-server batch everyone: the measured cost model.

With one stream the plain-run gate decides alone (`proxy.policies.plain_runs`). With
several, llama-server's continuous batching serves them in shared decode steps, and a
speculating stream's verify prompts join the same batches: its k extra tokens slow
every other stream by what k more tokens cost in a batch. On a GPU a few more tokens
per step cost little; on the 2-core CPU each costs nearly a step; on Strix Halo a batch
of up to 8 tokens costs about one step.

The model, in units of one plain decode step `p` (measured: the plain-run gate's ms per
token), with `r` the measured share of a step that one more token in the batch costs
(the draft-length policy's fitted verify ms per extra draft, over `p`):

    step(b tokens)      = 1 + (b - 1) r
    all plain, n streams: n / step(n) tokens per p, each stream 1 / step(n)
    m of n speculate k:   ((n - m) + m G (1 + k r)) / step(n + m k) tokens per p

where G = p / (speculation's measured ms per token alone) is what speculation gains a
lone stream (its rounds cost about step(k + 1)). A k is allowed where the aggregate
beats all-plain by `HYSTERESIS` and no plain stream slows by more than
`PER_STREAM_TOLERANCE` (the issue's 1.1x first-token and per-stream bound); the largest
such k wins, and none means the speculating streams yield their slots (plain runs)
until the load is gone. Nothing measured means no speculation under load: plain
batching is what llama-server alone would do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

UnderLoad = Literal["auto", "plain"]

HYSTERESIS = 0.05  # speculating must beat all-plain aggregate by this share
PER_STREAM_TOLERANCE = 0.10  # a plain stream may slow by at most this share


@dataclass(frozen=True)
class LoadMeasures:
    """What the proxy measured alone (ms; None: not measured yet)."""

    plain_ms_per_token: float | None
    spec_ms_per_token: float | None
    batch_token_ms: float | None  # what one more token in a batch adds (verify ms per draft)

    @property
    def speedup(self) -> float | None:
        """G: plain ms per token over speculative ms per token, alone."""
        if not self.plain_ms_per_token or not self.spec_ms_per_token:
            return None
        return self.plain_ms_per_token / self.spec_ms_per_token

    @property
    def batch_share(self) -> float | None:
        """r: one more token in a batch, as a share of a plain step."""
        if not self.plain_ms_per_token or self.batch_token_ms is None:
            return None
        return max(self.batch_token_ms, 0.0) / self.plain_ms_per_token


def step_cost(tokens: int, r: float) -> float:
    """A decode step of `tokens` tokens, in plain steps."""
    return 1.0 + max(tokens - 1, 0) * r


def aggregate_plain(n: int, r: float) -> float:
    """Tokens per plain step when n streams decode plainly in shared batches."""
    return n / step_cost(n, r)


def aggregate_speculating(n: int, m: int, k: int, speedup: float, r: float) -> float:
    """Tokens per plain step when m of n streams speculate k drafts a round."""
    return ((n - m) + m * speedup * step_cost(k + 1, r)) / step_cost(n + m * k, r)


def plain_stream_slowdown(n: int, m: int, k: int, r: float) -> float:
    """How much longer each plain stream's steps take when m speculate k."""
    return step_cost(n + m * k, r) / step_cost(n, r)


def k_under_load(n: int, m: int, k_max: int, measures: LoadMeasures) -> int:
    """The most drafts a round may verify when m of n streams speculate (m >= 1,
    n >= 2); 0: speculating loses to llama-server's batching here."""
    speedup, r = measures.speedup, measures.batch_share
    if speedup is None or r is None or speedup <= 1.0:
        return 0
    baseline = aggregate_plain(n, r)
    own_plain = 1.0 / step_cost(n, r)  # what a speculating stream would get plainly
    for k in range(k_max, 0, -1):
        if n > m and plain_stream_slowdown(n, m, k, r) > 1.0 + PER_STREAM_TOLERANCE:
            continue
        own = speedup * step_cost(k + 1, r) / step_cost(n + m * k, r)
        if own < own_plain:
            continue
        if aggregate_speculating(n, m, k, speedup, r) >= baseline * (1.0 + HYSTERESIS):
            return k
    return 0


class LoadGate:
    """`k_for(n, m, k_max)`: the drafts one of m speculating streams (of n) may verify a
    round, from `measure()` (read afresh at each decision: the policies keep learning)."""

    def __init__(self, mode: UnderLoad, measure: Callable[[], LoadMeasures] | None = None):
        self.mode = mode
        self.measure = measure

    def k_for(self, n: int, m: int, k_max: int) -> int:
        if n <= 1:
            return k_max  # alone: the plain-run gate decides, as before
        if self.mode == "plain" or self.measure is None:
            return 0
        return k_under_load(n, max(m, 1), k_max, self.measure())
