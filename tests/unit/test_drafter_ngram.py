"""Prompt-lookup drafting and the combined (n-gram, else model) drafter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from npu_draft.load import load_drafter, parse_ngram_spec
from npu_draft.ngram import (
    CombinedDraftSession,
    NgramDraftModel,
    NgramDraftSession,
    lookup_continuation,
)
from npu_draft.protocol import GREEDY, Draft, SamplingParams, SyncStats, common_prefix_length


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # last 3-gram [1, 2, 3] occurs at 0 -> continues 4, 5, 9
    assert lookup_continuation(seq, 3, (3,)) == [4, 5, 9]
    # with 2-grams only, [2, 3] last occurred at 6 -> continues 7, 8
    assert lookup_continuation(seq, 2, (2,)) == [7, 8]


def test_longer_ngram_wins_over_more_recent_shorter_one() -> None:
    seq = [5, 6, 7, 100, 9, 6, 7, 200, 5, 6, 7]
    assert lookup_continuation(seq, 1, (3, 2)) == [100]
    assert lookup_continuation(seq, 1, (2,)) == [200]


def test_no_match_proposes_nothing() -> None:
    assert lookup_continuation([1, 2, 3, 4, 5], 4, (3, 2, 1)) == []
    assert lookup_continuation([], 4) == []
    assert lookup_continuation([1, 2, 1, 2], 0) == []


def test_continuation_stops_at_end_of_sequence() -> None:
    # [1, 2] at 0 continues with 1, 2 (the match itself overlaps the suffix)
    assert lookup_continuation([1, 2, 1, 2], 5, (2,)) == [1, 2]


def test_session_appends_proposal_and_sync_rolls_back() -> None:
    session = NgramDraftModel((2,)).open_session()
    stats = session.sync([1, 2, 3, 4, 1, 2])
    assert stats == SyncStats(reused=0, appended=6)
    draft = session.propose(3)
    assert draft.tokens == [3, 4, 1] and draft.probs == [1.0] * 3 and draft.dists is None
    assert list(session.tokens) == [1, 2, 3, 4, 1, 2, 3, 4, 1]
    assert session.sync([1, 2, 3, 4, 1, 2, 3, 9]) == SyncStats(reused=7, appended=1)
    assert session.propose(3).tokens == []


def test_sampling_mode_gives_point_masses() -> None:
    session = NgramDraftSession((2,))
    session.sync([7, 8, 9, 7, 8])
    draft = session.propose(2, SamplingParams(temperature=0.8))
    assert draft.tokens == [9, 7]
    assert draft.dists is not None
    assert [d.prob_of(t) for d, t in zip(draft.dists, draft.tokens, strict=True)] == [1.0, 1.0]


def test_sizes_are_configurable_through_load() -> None:
    assert parse_ngram_spec("ngram:4,2") == (4, 2)
    assert parse_ngram_spec("ngram") == (3, 2)
    assert parse_ngram_spec("/some/folder") is None
    with pytest.raises(ValueError, match="n-gram sizes"):
        parse_ngram_spec("ngram:x")
    model = load_drafter("ngram:4")
    assert model.info.backend == "ngram" and model.info.provider == "none"
    session = model.open_session()
    session.sync([1, 2, 3, 9, 5, 1, 2, 3])  # only a 3-gram matches; 4 is required
    assert session.propose(2).tokens == []
    with pytest.raises(ValueError):
        NgramDraftModel((0,))


class CountingModelSession:
    """A model stand-in that always drafts 42, 43, ... and records its syncs."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self.proposals = 0

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        reused = common_prefix_length(self._tokens, tokens)
        self._tokens = list(tokens)
        return SyncStats(reused, len(tokens) - reused)

    def propose(self, k, sampling=GREEDY, rng=None, cancel=None) -> Draft:
        self.proposals += 1
        out = list(range(42, 42 + k))
        self._tokens += out
        return Draft(out, [0.5] * k)

    def next_logits(self) -> np.ndarray:
        return np.zeros(4, np.float32)

    def close(self) -> None:
        pass


def test_combined_uses_long_ngram_else_model() -> None:
    model = CountingModelSession()
    combined = CombinedDraftSession(model, NgramDraftSession((2,)), min_ngram_tokens=3)
    combined.sync([1, 2, 3, 4, 5, 1, 2])  # [1, 2] seen at 0: continues 3, 4, 5
    draft = combined.propose(3)
    assert (draft.tokens, combined.last_source, model.proposals) == ([3, 4, 5], "ngram", 0)

    combined.sync([9, 8, 7])  # no match at all
    draft = combined.propose(3)
    assert (draft.tokens, combined.last_source) == ([42, 43, 44], "model")
    assert list(combined.tokens) == [9, 8, 7, 42, 43, 44]


def test_combined_short_ngram_falls_back_to_model() -> None:
    model = CountingModelSession()
    combined = CombinedDraftSession(model, NgramDraftSession((2,)), min_ngram_tokens=3)
    combined.sync([5, 6, 5, 6])  # [5, 6] seen at 0: only 2 tokens follow it
    assert combined.propose(2).tokens == [5, 6]  # k = 2: two tokens are all that is asked
    assert combined.last_source == "ngram"

    combined.sync([5, 6, 5, 6])
    draft = combined.propose(4)  # 2 < 3 tokens: the model drafts
    assert (draft.tokens, combined.last_source) == ([42, 43, 44, 45], "model")
    assert list(model.tokens) == [5, 6, 5, 6, 42, 43, 44, 45]
    assert list(combined.tokens) == list(model.tokens)
