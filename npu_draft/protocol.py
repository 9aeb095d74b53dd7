"""The contract between the proxy engine and every draft backend.

A *draft model* is loaded once (weights, execution provider, tokenizer facts) and
opens one *draft session* per conversation. A session owns the drafter's cache for
one token sequence:

    session.sync(committed)        # roll back to the common prefix, append the rest
    draft = session.propose(k)     # k greedy (or sampled) tokens after `committed`
    ... the server verifies ...
    session.sync(committed + accepted + [correction])   # O(new tokens)

`sync` never re-prefills when the new sequence extends a prefix the session has
already seen (drafted tokens included): rollback is a length change.

Sessions are synchronous and not thread-safe; `AsyncDraftSession` (see
`npu_draft.async_session`) runs one on a worker thread it holds while open, so the event
loop never blocks, and lets a draft in progress be cancelled between tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """The sampling chain the target server applies, mirrored on the draft side.

    temperature == 0 means greedy. top_k <= 0 and top_p >= 1 and min_p <= 0 disable
    those stages. The order is llama.cpp's default: top_k, top_p, min_p, temperature.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class SparseDist:
    """A probability distribution over token ids (ids not listed have probability 0)."""

    ids: np.ndarray  # int64, shape [n]
    probs: np.ndarray  # float64, shape [n], sums to 1

    def prob_of(self, token: int) -> float:
        hit = np.nonzero(self.ids == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0


@dataclass
class Draft:
    """Tokens proposed after the synced sequence, in order.

    probs[i] is the draft's probability of tokens[i]: the plain softmax at
    temperature 1 in greedy mode (a confidence for choosing k), the probability
    under the sampling chain in sampling mode. dists[i] is the whole draft
    distribution q at position i in sampling mode, else None. runner_ups[i] is the
    greedy draft's second choice at position i, where the drafter offers one (empty
    where it does not): the engine drafts the line after it for the case the target
    rejects tokens[i].
    """

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    dists: list[SparseDist] | None = None
    runner_ups: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class SyncStats:
    reused: int  # tokens kept from the session's cache
    appended: int  # tokens newly run through the model


@dataclass(frozen=True)
class DrafterInfo:
    """What the proxy needs to know about a loaded draft model."""

    name: str  # folder or model name, for logs and errors
    backend: str  # "onnx", "genai", "ngram", ...
    provider: str  # execution provider that actually runs it ("cpu", "cuda", "npu", "none")
    vocab_size: int | None  # None for model-free drafters
    max_context: int  # longest sequence a session can hold
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tokenizer_fingerprint: str | None = None  # see npu_draft.tokenizer_check


class CancelToken:
    """Set from any thread; a running propose() stops after its current token."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


class DraftCancelled(Exception):
    """Raised by an async wrapper when the caller cancelled the draft."""


@runtime_checkable
class DraftSession(Protocol):
    def sync(self, tokens: Sequence[int]) -> SyncStats:
        """Make the session's sequence equal `tokens` (rollback + append)."""
        ...

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        """Propose up to k tokens after the synced sequence.

        May return fewer than k (end of context, cancellation, or a model-free
        drafter without a match). The proposed tokens become part of the session's
        sequence until the next sync.
        """
        ...

    def next_logits(self) -> np.ndarray:
        """Raw logits (float32, [vocab]) for the token after the current sequence."""
        ...

    @property
    def tokens(self) -> Sequence[int]:
        """The session's current sequence (synced tokens plus any drafted ones)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DraftModel(Protocol):
    info: DrafterInfo

    def open_session(self) -> DraftSession: ...

    def close(self) -> None: ...


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
