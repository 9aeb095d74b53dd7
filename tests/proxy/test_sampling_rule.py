"""The speculative sampling rule, checked by exact enumeration of every outcome.

`Enumerator` runs a computation once per path through its random choices (draft
draws, the server's draws, the rule's coin flips and residual draws) and adds up
each path's probability, so the induced output distribution is computed exactly
(to float rounding) and compared with the target's p.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable

import numpy as np
import pytest

from npu_draft.protocol import SparseDist
from proxy.engine.acceptance import (
    RngChooser,
    Verdict,
    acceptance_probability,
    draft_dist_for,
    residual,
    speculative_sample,
    without,
)

TOL = 1e-12


def dist(mapping: dict[int, float]) -> SparseDist:
    ids = np.array(list(mapping), dtype=np.int64)
    probs = np.array(list(mapping.values()), dtype=np.float64)
    return SparseDist(ids, probs / probs.sum())


def as_dict(d: SparseDist) -> dict[int, float]:
    return {int(t): float(p) for t, p in zip(d.ids, d.probs, strict=True) if p > 0}


class PathChooser:
    """A Chooser that follows a script of branch indices and records every branch."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.trace: list[list[float]] = []  # branch probabilities at each choice
        self.taken: list[int] = []  # the branch followed at each choice

    def _pick(self, probs: list[float]) -> int:
        step = len(self.trace)
        self.trace.append(probs)
        # past the script: the first branch that can happen
        branch = self.script[step] if step < len(self.script) else probs.index(max(probs))
        self.taken.append(branch)
        return branch

    def bernoulli(self, prob: float) -> bool:
        return self._pick([prob, 1.0 - prob]) == 0

    def categorical(self, d: SparseDist) -> int:
        return int(d.ids[self._pick([float(p) for p in d.probs])])

    def draw(self, mapping: dict[Hashable, float]):
        """A world draw (draft model, server) over arbitrary outcomes."""
        keys = list(mapping)
        return keys[self._pick([mapping[k] for k in keys])]


def enumerate_outcomes(run: Callable[[PathChooser], Hashable]) -> dict[Hashable, float]:
    """Exact distribution of run(chooser)'s result over all choice paths."""
    out: dict[Hashable, float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        script = stack.pop()
        chooser = PathChooser(script)
        outcome = run(chooser)
        taken = chooser.taken
        prob = math.prod(chooser.trace[i][b] for i, b in enumerate(taken))
        for i in range(len(script), len(chooser.trace)):
            for branch, p in enumerate(chooser.trace[i]):
                if p > 0 and branch != taken[i]:
                    stack.append([*taken[:i], branch])
        if prob > 0:
            out[outcome] += prob
    return dict(out)


def assert_same_distribution(got: dict, want: dict) -> None:
    keys = set(got) | set(want)
    worst = max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in keys)
    assert worst < TOL, f"max deviation {worst:.3g}\n got  {got}\n want {want}"


# -- one position: x ~ q, then the rule --------------------------------------------

P = dist({0: 0.5, 1: 0.3, 2: 0.2})
ONE_POSITION_CASES = {
    "q equal to p": P,
    "q flatter": dist({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}),  # 3 is outside p's top-N
    "q sharper": dist({0: 0.9, 1: 0.1}),  # q(2) = 0 although p(2) > 0
    "q disjoint": dist({5: 0.6, 6: 0.4}),  # every draft rejected
    "q point mass inside p": dist({1: 1.0}),
    "q point mass outside p": dist({7: 1.0}),
}


@pytest.mark.parametrize("q", ONE_POSITION_CASES.values(), ids=ONE_POSITION_CASES.keys())
def test_one_draft_then_bonus_outputs_p(q):
    p2 = {0: dist({0: 0.7, 1: 0.3}), 1: dist({2: 1.0}), 2: dist({0: 0.1, 2: 0.9})}

    def run(chooser: PathChooser):
        x = chooser.draw(as_dict(q))
        after = p2.get(x, dist({4: 1.0}))  # a rejected x never reaches position 1
        verdicts = [Verdict(-1, P), Verdict(-1, after)]
        return tuple(speculative_sample([x], [q], verdicts, chooser).tokens)

    got = enumerate_outcomes(run)
    # a round commits the accepted draft plus a bonus, or one residual token:
    # compare the distribution of the first token, and of both when there are two
    first = defaultdict(float)
    for tokens, prob in got.items():
        first[tokens[0]] += prob
    assert_same_distribution(dict(first), as_dict(P))
    two = {t: pr for t, pr in got.items() if len(t) == 2}
    for (a, b), prob in two.items():
        accepted = sum(pr for t, pr in two.items() if t[0] == a)
        assert abs(prob / accepted - as_dict(p2[a])[b]) < TOL  # the bonus is drawn from p


def test_acceptance_and_residual_values():
    q = dist({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25})
    assert acceptance_probability(P, q, 0) == 1.0  # p >= q: always kept
    assert acceptance_probability(P, q, 2) == pytest.approx(0.8)
    assert acceptance_probability(P, q, 3) == 0.0  # outside the server's candidates
    assert as_dict(residual(P, q)) == pytest.approx({0: 0.25 / 0.30, 1: 0.05 / 0.30})


def test_all_zero_residual_falls_back_to_p():
    # p <= q everywhere (p == q on p's support): nothing left, p is the limit
    assert as_dict(residual(P, P)) == pytest.approx(as_dict(P))
    wider = dist({0: 0.5, 1: 0.3, 2: 0.2})
    assert as_dict(residual(P, wider)) == pytest.approx(as_dict(P))


def test_missing_or_zero_q_means_the_point_mass():
    assert as_dict(draft_dist_for(None, 4)) == {4: 1.0}
    assert as_dict(draft_dist_for(dist({0: 1.0}), 4)) == {4: 1.0}  # q(x) = 0
    q = dist({0: 0.5, 4: 0.5})
    assert draft_dist_for(q, 4) is q
    # with the point mass: accept with p(x), else draw from p without x
    point = draft_dist_for(None, 1)
    assert acceptance_probability(P, point, 1) == pytest.approx(0.3)
    assert as_dict(residual(P, point)) == pytest.approx({0: 0.5 / 0.7, 2: 0.2 / 0.7})


@pytest.mark.parametrize("proposal", [{0: 1.0}, {1: 0.5, 2: 0.5}, {0: 0.1, 3: 0.9}])
def test_any_proposal_without_q_is_exact(proposal):
    """Drafts whose q is unknown (n-gram, greedy-only backends) lose nothing."""

    def run(chooser: PathChooser):
        x = chooser.draw(proposal)
        verdicts = [Verdict(-1, P), Verdict(-1, dist({9: 1.0}))]
        return speculative_sample([x], None, verdicts, chooser).tokens[0]

    assert_same_distribution(enumerate_outcomes(run), as_dict(P))


def test_q_zero_for_the_drafted_token_stays_exact():
    """A drafter whose reported q gives its own token probability 0 (the token did
    not come from that q) is treated as a point mass for that token: still exact."""
    reported = dist({0: 1.0})

    def run(chooser: PathChooser):
        verdicts = [Verdict(-1, P), Verdict(-1, dist({9: 1.0}))]
        return speculative_sample([2], [reported], verdicts, chooser).tokens[0]

    assert_same_distribution(enumerate_outcomes(run), as_dict(P))


# -- whole generations: several rounds, k drafts, partial UTF-8 tokens ---------------

VOCAB = range(4)
PARTIAL = frozenset({3})  # token 3's piece ends inside a UTF-8 character


def target(prefix: tuple[int, ...]) -> dict[int, float]:
    """A context-dependent p with full support, token 3 included."""
    h = (sum((i + 1) * (t + 2) for i, t in enumerate(prefix)) * 7 + len(prefix)) % 5
    w = [1.0 + h, 2.0, 0.5 + (h % 3), 0.7]
    return {t: w[t] / sum(w) for t in VOCAB}


def draft_model(prefix: tuple[int, ...]) -> dict[int, float]:
    """A q unlike p, with tokens outside p's support and gaps in it."""
    h = (len(prefix) + sum(prefix)) % 3
    table = [{0: 0.6, 1: 0.4}, {2: 0.5, 3: 0.3, 5: 0.2}, {1: 0.2, 3: 0.8}]
    return table[h]


def generate(chooser: PathChooser, k: int, n_tokens: int, server: str) -> tuple[int, ...]:
    """Rounds of the rule until n_tokens are out, with the server's draws either
    independent per prompt or sharing one uniform (one seed for the whole batch)."""
    out: tuple[int, ...] = ()
    while len(out) < n_tokens:
        draft: list[int] = []
        dists: list[SparseDist] = []
        for _ in range(k):
            q = draft_model(out + tuple(draft))
            draft.append(chooser.draw(q))
            dists.append(dist(q))
        ps = [target(out + tuple(draft[:i])) for i in range(k + 1)]
        # Only whether the server's draw is partial changes the output (then it sends
        # no probabilities), so branch on that alone; a full draw is the inverse CDF.
        if server == "independent":
            us = [1.0 if chooser.draw({True: p[3], False: 1 - p[3]}) else 0.0 for p in ps]
        else:  # one uniform u for the whole batch (one seed): cells between the cuts
            cuts = sorted({0.0, 1.0, *(1.0 - p[3] for p in ps)})
            u = chooser.draw({(lo + hi) / 2: hi - lo for lo, hi in itertools.pairwise(cuts)})
            us = [u] * len(ps)
        sampled = [inverse_cdf(p, u) for p, u in zip(ps, us, strict=True)]
        verdicts = [
            Verdict(t, None if t in PARTIAL else dist(p), PARTIAL)
            for t, p in zip(sampled, ps, strict=True)
        ]
        out += tuple(speculative_sample(draft, dists, verdicts, chooser).tokens)
    return out[:n_tokens]


def inverse_cdf(p: dict[int, float], u: float) -> int:
    """The token at quantile u; 1.0 stands for "the partial token" (3, the last)."""
    for token, cum in zip(p, itertools.accumulate(p.values()), strict=True):
        if u < cum:
            return token
    return 3


def exact_prefix_distribution(n_tokens: int) -> dict[tuple[int, ...], float]:
    out = {(): 1.0}
    for _ in range(n_tokens):
        out = {(*seq, t): pr * pt for seq, pr in out.items() for t, pt in target(seq).items()}
    return out


@pytest.mark.parametrize(
    ("k", "server"),
    [(1, "independent"), (2, "independent"), (1, "shared-seed"), (3, "shared-seed")],
)
def test_generation_has_exactly_the_targets_distribution(k, server):
    n_tokens = 2
    got = enumerate_outcomes(lambda chooser: generate(chooser, k, n_tokens, server))
    assert_same_distribution(got, exact_prefix_distribution(n_tokens))


def test_enumeration_catches_a_biased_rule(monkeypatch):
    """The exact check is sharp: using the full p at position 0 (ignoring that a
    partial-UTF-8 draw by the server hides the probabilities) is caught."""
    import proxy.engine.acceptance as acceptance

    monkeypatch.setattr(acceptance, "without", lambda d, excluded: d)
    got = enumerate_outcomes(lambda chooser: generate(chooser, 2, 2, "independent"))
    want = exact_prefix_distribution(2)
    assert max(abs(got.get(s, 0.0) - want[s]) for s in want) > 1e-3


def test_greedy_match_acceptance_is_reported_on_the_same_drafts():
    """n_matched counts drafts equal to the server's own draws, whatever the rule does."""
    p = dist({5: 0.5, 6: 0.5})
    verdicts = [Verdict(5, p), Verdict(6, p), Verdict(5, p)]
    result = speculative_sample([5, 7], None, verdicts, PathChooser([0]))  # accept 5; 7 has p 0
    assert (result.n_matched, result.n_accepted, result.tokens) == (1, 1, [5, 5])
    result = speculative_sample([6, 6], None, verdicts, PathChooser([]))
    assert (result.n_matched, result.n_accepted) == (0, 2)  # the rule keeps both


def test_missing_probabilities_handling():
    q = [dist({0: 1.0}), dist({1: 1.0})]
    # position 0 without probabilities: the server's own draw is committed, alone
    result = speculative_sample([0, 1], q, [Verdict(3, None), Verdict(1, P), Verdict(0, P)],
                                PathChooser([]))  # fmt: skip
    assert result.tokens == [3] and result.n_accepted == 0
    result = speculative_sample([3, 1], q, [Verdict(3, None), Verdict(1, P), Verdict(0, P)],
                                PathChooser([]))  # fmt: skip
    assert result.tokens == [3] and result.n_accepted == 1
    # a later position without probabilities ends the round after the accepted drafts
    always = dist({0: 1.0})
    result = speculative_sample([0, 1], q, [Verdict(0, always), Verdict(3, None), Verdict(1, P)],
                                PathChooser([]))  # fmt: skip
    assert result.tokens == [0] and result.n_accepted == 1


def test_partial_tokens_are_excluded_at_position_zero_only():
    p = dist({0: 0.5, 3: 0.5})
    assert as_dict(without(p, frozenset({3}))) == {0: 1.0}
    # the server drew 0 (so it sent probabilities): the rule must not output 3 here
    got = enumerate_outcomes(
        lambda c: tuple(speculative_sample([], None, [Verdict(0, p, frozenset({3}))], c).tokens)
    )
    assert got == {(0,): 1.0}


def test_rng_chooser_is_reproducible_and_draws_from_the_distribution():
    d = dist({10: 0.2, 11: 0.5, 12: 0.3})
    draws = [RngChooser(np.random.default_rng(3)).categorical(d) for _ in range(3)]
    assert len(set(draws)) == 1
    chooser = RngChooser(np.random.default_rng(0))
    counts = np.bincount([chooser.categorical(d) - 10 for _ in range(20000)], minlength=3)
    # 20000 draws: each frequency within 5 standard deviations (<= 0.018) of its p
    assert np.allclose(counts / 20000, [0.2, 0.5, 0.3], atol=0.018)
    assert RngChooser(np.random.default_rng(0)).bernoulli(1.0)
    assert not RngChooser(np.random.default_rng(0)).bernoulli(0.0)
