"""Acceptance rules: pure functions from (draft, target verdicts) to committed tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npu_draft.protocol import SparseDist

Dists = list[SparseDist | None] | None  # q per draft token in sampling mode (None: no q)


@dataclass(frozen=True)
class Acceptance:
    n_accepted: int  # leading draft tokens the target agreed with
    tokens: list[int]  # what the round commits: accepted drafts + the target's own token
    n_drafted: int

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted and the last token is the free one."""
        return self.n_drafted > 0 and self.n_accepted == self.n_drafted


def greedy_accept(draft: Sequence[int], target: Sequence[int]) -> Acceptance:
    """Greedy rule: keep drafts while they equal the target's argmax, then its token.

    target[i] is the target's greedy token after the context plus draft[:i], so
    len(target) == len(draft) + 1. The result is exactly what plain greedy decoding
    would have produced for those positions.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target tokens for {len(draft)} drafts")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return Acceptance(n_accepted=n, tokens=[*draft[:n], target[n]], n_drafted=len(draft))


def accepted_per_position(n_accepted: int, n_drafted: int) -> list[bool]:
    """Which draft positions (0-based) were accepted in one round, for per-position stats."""
    return [i < n_accepted for i in range(n_drafted)]


# -- sampling: the Leviathan/Chen rule -------------------------------------------------
#
# p is the target's distribution after the request's sampling chain, exactly as the
# server samples from it (verify with n_probs >= top_k and post_sampling_probs); q is
# the distribution the draft token was drawn from. Accepting x ~ q with probability
# min(1, p(x)/q(x)) and otherwise drawing from norm(max(0, p - q)) outputs exactly p.


class Chooser(Protocol):
    """The rule's only source of randomness (tests enumerate its branches exactly)."""

    def bernoulli(self, prob: float) -> bool: ...

    def categorical(self, dist: SparseDist) -> int: ...


class RngChooser:
    """Chooser over a numpy Generator: a seeded request replays the same choices."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def bernoulli(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def categorical(self, dist: SparseDist) -> int:
        # inverse CDF by hand: one uniform per draw, whatever the support size
        cum = np.cumsum(dist.probs)
        index = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        return int(dist.ids[min(index, len(dist.ids) - 1)])


@dataclass(frozen=True)
class Verdict:
    """What the server reported for one prompt of a sampling verify batch."""

    sampled: int  # the server's own draw from p (seeded by the proxy)
    dist: SparseDist | None  # p; None when the server sent no probabilities
    partial: frozenset[int] = frozenset()  # ids of p whose piece ends inside a UTF-8 char


@dataclass(frozen=True)
class SampledAcceptance(Acceptance):
    # drafts a match-only rule would have kept: leading drafts equal to the server's
    # own sampled tokens of the same batch (what "greedy-match" front ends accept)
    n_matched: int = 0


def point_mass(token: int) -> SparseDist:
    return SparseDist(np.array([token], dtype=np.int64), np.array([1.0]))


def normalized(ids: np.ndarray, weights: np.ndarray) -> SparseDist | None:
    """The distribution proportional to the positive weights; None if there are none."""
    keep = weights > 0.0
    total = float(weights[keep].sum())
    if total <= 0.0:
        return None
    return SparseDist(ids[keep].astype(np.int64), weights[keep] / total)


def without(dist: SparseDist, excluded: frozenset[int]) -> SparseDist | None:
    """`dist` conditioned on not being one of `excluded`."""
    if not excluded:
        return dist
    mask = np.array([int(t) not in excluded for t in dist.ids], dtype=bool)
    return normalized(dist.ids[mask], dist.probs[mask])


def draft_dist_for(q: SparseDist | None, token: int) -> SparseDist:
    """The q to use for a drafted token.

    No q, or q(token) == 0 (the token cannot have come from q), means the point mass
    at the token. The rule with a point mass is exact for ANY proposal that does not
    look at the rule's randomness: accept with p(x), else draw from p without x.
    When x really is drawn from q, q(x) > 0 always, so this never changes the rule.
    """
    if q is None or q.prob_of(token) <= 0.0:
        return point_mass(token)
    return q


def acceptance_probability(p: SparseDist, q: SparseDist, token: int) -> float:
    """min(1, p(x)/q(x)); p(x) == 0 (outside the server's candidates) rejects."""
    q_x = q.prob_of(token)
    return 1.0 if q_x <= 0.0 else min(1.0, p.prob_of(token) / q_x)


def residual(p: SparseDist, q: SparseDist) -> SparseDist:
    """norm(max(0, p - q)), where the first rejection draws from.

    All zero means p <= q everywhere, i.e. p == q: then a rejection has probability
    zero in exact arithmetic and happens only through rounding; p itself is the
    limit of the residual draw and keeps the output exact up to that rounding.
    """
    q_on_p = np.array([q.prob_of(int(t)) for t in p.ids])
    return normalized(p.ids, np.maximum(p.probs - q_on_p, 0.0)) or p


def speculative_sample(
    draft: Sequence[int],
    draft_dists: Sequence[SparseDist | None] | None,
    verdicts: Sequence[Verdict],
    chooser: Chooser,
) -> SampledAcceptance:
    """One round of lossless speculative sampling over k drafts and k+1 verdicts.

    verdicts[i] is the target after the context plus draft[:i]. Missing
    probabilities (the server drops them when its own sampled token ends inside a
    UTF-8 character, tools/server process_token) are handled so the output stays
    exactly p:
      - at position 0 the server's draw t ~ p is fresh (new seed per round). If t is
        partial we commit t. If not, p is known and partial tokens were excluded by
        that very event, so we draw from p without the partial tokens:
        P(y) = p(y) for partial y, p(not partial) * p(y)/p(not partial) otherwise.
      - at a later position the server's draw shares its seed with the earlier
        prompts of the batch, so it is not a clean sample given what we already
        saw: end the round after the accepted drafts; the next round samples that
        position afresh. At positions >= 1 we always use the full p, because the
        "end here" branch also yields p.
    """
    k = len(draft)
    if len(verdicts) != k + 1:
        raise ValueError(f"need {k + 1} verdicts for {k} drafts")
    if draft_dists is not None and len(draft_dists) < k:
        raise ValueError("fewer draft distributions than draft tokens")
    n_matched = 0
    while n_matched < k and draft[n_matched] == verdicts[n_matched].sampled:
        n_matched += 1

    def done(n_accepted: int, tokens: list[int]) -> SampledAcceptance:
        return SampledAcceptance(n_accepted, tokens, k, n_matched=n_matched)

    tokens: list[int] = []
    for i, verdict in enumerate(verdicts):
        if verdict.dist is None:
            if i > 0:
                return done(i, tokens)
            accepted = int(k > 0 and draft[0] == verdict.sampled)
            return done(accepted, [verdict.sampled])
        p = verdict.dist if i > 0 else without(verdict.dist, verdict.partial)
        if p is None:  # cannot happen: the server's own draw is in p and not partial
            return done(i, [*tokens, verdict.sampled]) if i == 0 else done(i, tokens)
        if i == k:
            return done(k, [*tokens, chooser.categorical(p)])  # all accepted: bonus from p
        token = int(draft[i])
        q = draft_dist_for(draft_dists[i] if draft_dists is not None else None, token)
        if chooser.bernoulli(acceptance_probability(p, q, token)):
            tokens.append(token)
            continue
        return done(i, [*tokens, chooser.categorical(residual(p, q))])
    raise AssertionError("unreachable")
