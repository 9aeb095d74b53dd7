"""Statistics for the sampling tests: a chi-square goodness-of-fit test against an
exactly known distribution (no scipy in the test environment)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularised upper gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1.0:  # series for the lower function P converges fast here
        term = total = 1.0 / a
        n = a
        while abs(term) > total * 1e-16:
            n += 1.0
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    # modified Lentz continued fraction for Q
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


@dataclass(frozen=True)
class GofResult:
    statistic: float
    df: int
    p_value: float
    impossible: dict  # outcomes observed that have probability 0 under the null


def chi_square_gof(
    counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], min_expected: float = 5.0
) -> GofResult:
    """Pearson's test of `counts` against the exact distribution `probs`.

    Cells expected fewer than `min_expected` times are pooled (smallest first) so the
    chi-square approximation holds; an outcome outside the support is reported, not
    pooled: it alone disproves the null.
    """
    n = sum(counts.values())
    impossible = {o: c for o, c in counts.items() if probs.get(o, 0.0) <= 0.0}
    cells = sorted(((p * n, counts.get(o, 0)) for o, p in probs.items() if p > 0), reverse=True)
    pooled: list[tuple[float, int]] = []
    rest_e, rest_o = 0.0, 0
    for expected, observed in cells:
        if expected >= min_expected:
            pooled.append((expected, observed))
        else:
            rest_e, rest_o = rest_e + expected, rest_o + observed
    if rest_e > 0:
        if rest_e < min_expected and pooled:
            e, o = pooled.pop()
            rest_e, rest_o = rest_e + e, rest_o + o
        pooled.append((rest_e, rest_o))
    statistic = sum((o - e) ** 2 / e for e, o in pooled)
    df = len(pooled) - 1
    return GofResult(statistic, df, chi2_sf(statistic, df) if df > 0 else 1.0, impossible)
