"""Backend `ngram`: model-free prompt-lookup drafting, and a combined drafter.

Prompt lookup (as in transformers' PromptLookupCandidateGenerator and vLLM's n-gram
proposer): find the most recent earlier occurrence of the sequence's last n tokens
and propose what followed it. Longer n-grams are tried first because they predict
better; without a match nothing is proposed. It costs microseconds and wins on
edits and code that repeat the prompt.

The combined drafter takes the n-gram continuation when it is long enough to be
worth a round on its own, and the model's draft otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DrafterInfo,
    DraftModel,
    DraftSession,
    SamplingParams,
    SparseDist,
    SyncStats,
    common_prefix_length,
)


def lookup_continuation(
    tokens: Sequence[int], k: int, ngram_sizes: Sequence[int] = (3, 2)
) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens,
    trying the n in ngram_sizes from longest to shortest; [] without a match."""
    if k <= 0:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in sorted(set(ngram_sizes), reverse=True):
        if n <= 0 or len(seq) <= n:
            continue
        suffix = seq[-n:]
        # windows[i] = seq[i : i + n]; the last window is the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n  # most recent match: the freshest context
            return seq[start : start + k].tolist()
    return []


class NgramDraftSession:
    """Keeps the conversation's tokens; proposals are lookups into them."""

    def __init__(self, ngram_sizes: Sequence[int]) -> None:
        self.ngram_sizes = tuple(ngram_sizes)
        self._tokens: list[int] = []

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        reused = common_prefix_length(self._tokens, tokens)
        self._tokens = list(tokens)
        return SyncStats(reused=reused, appended=len(tokens) - reused)

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        found = lookup_continuation(self._tokens, k, self.ngram_sizes)
        self._tokens.extend(found)
        # A lookup is a point mass: q(x) = 1, so the target accepts x with p(x).
        return Draft(
            tokens=found,
            probs=[1.0] * len(found),
            dists=None
            if sampling.greedy
            else [SparseDist(np.array([t], dtype=np.int64), np.array([1.0])) for t in found],
        )

    def next_logits(self) -> np.ndarray:
        raise NotImplementedError("the n-gram drafter has no logits")

    def close(self) -> None:
        self._tokens = []


class NgramDraftModel:
    def __init__(self, ngram_sizes: Sequence[int] = (3, 2), max_context: int = 1 << 20) -> None:
        if not ngram_sizes or min(ngram_sizes) <= 0:
            raise ValueError(f"n-gram sizes must be positive, got {list(ngram_sizes)}")
        self.ngram_sizes = tuple(ngram_sizes)
        self.info = DrafterInfo(
            name=f"ngram{'/'.join(map(str, self.ngram_sizes))}",
            backend="ngram",
            provider="none",
            vocab_size=None,
            max_context=max_context,
        )

    def open_session(self) -> NgramDraftSession:
        return NgramDraftSession(self.ngram_sizes)

    def close(self) -> None:
        pass


class CombinedDraftSession:
    """N-gram continuation when at least `min_ngram_tokens` long, the model otherwise."""

    def __init__(
        self, model_session: DraftSession, ngram_session: NgramDraftSession, min_ngram_tokens: int
    ) -> None:
        self._model = model_session
        self._ngram = ngram_session
        self.min_ngram_tokens = min_ngram_tokens
        self.last_source = ""  # "ngram" or "model": which one made the last draft

    @property
    def tokens(self) -> Sequence[int]:
        return self._ngram.tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        self._ngram.sync(tokens)
        # The model catches up lazily here: after an n-gram round its cache still
        # ends at the previous sync, and the accepted tokens are just new tokens.
        return self._model.sync(tokens)

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        committed = list(self._ngram.tokens)
        found = lookup_continuation(committed, k, self._ngram.ngram_sizes)
        if len(found) >= min(self.min_ngram_tokens, k):
            self.last_source = "ngram"
            return self._ngram.propose(k, sampling, rng, cancel)
        self.last_source = "model"
        if list(self._model.tokens) != committed:  # the last draft was the n-gram's
            self._model.sync(committed)
        draft = self._model.propose(k, sampling, rng, cancel)
        self._ngram.sync(committed + draft.tokens)
        return draft

    def next_logits(self) -> np.ndarray:
        self._model.sync(self._ngram.tokens)
        return self._model.next_logits()

    def close(self) -> None:
        self._model.close()
        self._ngram.close()


class CombinedDraftModel:
    def __init__(
        self,
        model: DraftModel,
        ngram_sizes: Sequence[int] = (3, 2),
        min_ngram_tokens: int = 3,
    ) -> None:
        self.model = model
        self.ngram = NgramDraftModel(ngram_sizes)
        self.min_ngram_tokens = min_ngram_tokens
        inner = model.info
        self.info = DrafterInfo(
            name=f"{inner.name}+{self.ngram.info.name}",
            backend=f"{inner.backend}+ngram",
            provider=inner.provider,
            vocab_size=inner.vocab_size,
            max_context=inner.max_context,
            eos_token_ids=inner.eos_token_ids,
            bos_token_id=inner.bos_token_id,
            tokenizer_fingerprint=inner.tokenizer_fingerprint,
        )

    def open_session(self) -> CombinedDraftSession:
        return CombinedDraftSession(
            self.model.open_session(), self.ngram.open_session(), self.min_ngram_tokens
        )

    def close(self) -> None:
        self.model.close()
