"""A sampling request the speculative path mirrors exactly, and its bound.

Read from the request by the API, sent by the client, drawn from by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from npu_draft.protocol import SamplingParams

MAX_VERIFY_TOP_K = 128  # beyond this the per-round JSON gets heavy: pass through instead


@dataclass(frozen=True)
class SamplingSpec:
    """A sampling request the speculative path mirrors exactly."""

    chain: SamplingParams  # effective values: temperature > 0, 1 <= top_k <= MAX_VERIFY_TOP_K
    min_keep: int = 0
    seed: int | None = None  # None: unseeded (fresh entropy)
