"""The cost model behind every benchmark table (docs/BENCHMARKS.md), as pure functions.

a: probability that a drafted token is accepted (i.i.d. per position); k drafts
per round. A round commits its accepted run plus the target's own next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


def expected_tokens_per_round(a: float, k: float) -> float:
    """E = (1 - a^(k+1)) / (1 - a): accepted run plus the correction or bonus token.
    A fractional k (the mean draft length of adaptive rounds) interpolates."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_round_ms(a: float, ms_after: dict[int, float]) -> float | None:
    """A k-draft round's mean time when its cost depends on how many of the previous
    round's k drafts were accepted (each slot catches up on the accepted tokens it
    lacks): sum over j of P(j) ms_after[j], with P(j) = a^j (1 - a) for j < k and a^k
    for j = k (k = the largest j given). None unless every j = 0..k is given."""
    k = max(ms_after, default=-1)
    if k < 0 or any(j not in ms_after for j in range(k + 1)):
        return None
    chance = [a**j * (1.0 - a) for j in range(k)] + [a**k]
    return sum(p * ms_after[j] for j, p in enumerate(chance))


def expected_accepted_per_round(a: float, k: int) -> float:
    return expected_tokens_per_round(a, k) - 1.0


def ceiling_speedup(a: float) -> float:
    """1/(1-a): the best case with a free draft and flat verification cost."""
    return float("inf") if a >= 1.0 else 1.0 / (1.0 - a)


def acceptance_from_positions(drafted: Sequence[int], accepted: Sequence[int]) -> float | None:
    """Maximum-likelihood a from per-position counters (position 0 first).

    accepted[i] counts rounds whose accepted run is longer than i; drafted[i] counts
    rounds that drafted position i. A round that reached position i (accepted the
    i earlier ones) and drafted it either accepts or rejects it, so
    a = sum(accepted) / sum(reached), reached[i] = min(accepted[i-1], drafted[i]).
    """
    reached_total = 0
    accepted_total = 0
    for i, n_drafted in enumerate(drafted):
        reached = n_drafted if i == 0 else min(accepted[i - 1], n_drafted)
        reached_total += reached
        accepted_total += accepted[i] if i < len(accepted) else 0
    if reached_total <= 0:
        return None
    return accepted_total / reached_total


@dataclass(frozen=True)
class Prediction:
    tokens_per_round: float  # E(a, k)
    round_ms_turns: float  # k*t_draft + t_verify + t_overhead
    round_ms_overlapped: float  # max(k*t_draft, t_verify + t_overhead)
    tokens_per_s_turns: float
    tokens_per_s_overlapped: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def predict(
    a: float, k: float, draft_ms_per_token: float, verify_ms: float, overhead_ms: float
) -> Prediction:
    """Predicted speed taking turns (draft, then verify) and with drafting overlapped."""
    tokens = expected_tokens_per_round(a, k)
    drafting = k * draft_ms_per_token
    turns = drafting + verify_ms + overhead_ms
    overlapped = max(drafting, verify_ms + overhead_ms)
    return Prediction(
        tokens_per_round=tokens,
        round_ms_turns=turns,
        round_ms_overlapped=overlapped,
        tokens_per_s_turns=1e3 * tokens / turns if turns > 0 else float("inf"),
        tokens_per_s_overlapped=1e3 * tokens / overlapped if overlapped > 0 else float("inf"),
    )


# -- ceilings: the best any drafter could do on this server (issue 16, item 4) ----


@dataclass(frozen=True)
class Ceiling:
    tokens_per_s: float
    k: int  # the k that reaches it

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def overlap_round_ms(
    a: float, k: int, verify_ms: float, draft_ms_per_token: float, resync_ms: float
) -> float:
    """T(k) = t_v(k) + (1 - a^(k+1)) * (t_resync + k * t_d).

    Drafting ahead along the all-accepted line hides the next draft under this
    round's verification only when all k drafts and the drafter's guess of the bonus
    token are accepted (probability a^(k+1)); any other outcome waits for a re-sync
    and k fresh draft steps."""
    return verify_ms + (1.0 - a ** (k + 1)) * (resync_ms + k * draft_ms_per_token)


def multi_outcome_round_ms(
    a: float, k: int, verify_ms: float, draft_ms_per_token: float, resync_ms: float,
    lines: int, runner_up_hits: float, batch_cost: float = 1.0,
) -> float:  # fmt: skip
    """T(k) when the drafter drafts `lines` continuations in one batch while the server
    verifies: the all-accepted line (as `overlap_round_ms`) and, for each of the first
    `lines` - 1 positions (the likeliest rejection points: position i is rejected with
    probability a^i (1 - a)), the line after the draft's runner-up there. A rejection
    finds its block ready when the target's correction is that runner-up (probability
    `runner_up_hits`), so

        P_ready = a^(k+1) + h (1 - a^min(lines - 1, k))

    The batch of k + 1 tokens per line takes (k + 1) t_d `batch_cost` (`batch_cost` =
    what a step for `lines` sequences costs over one); what of it outlasts the
    verification is paid by the rounds that use it, and the others wait for a
    re-sync and k fresh steps. With lines = 1 this is `overlap_round_ms` plus what
    drafting the k + 1 tokens ahead takes beyond the verification."""
    covered = min(max(lines - 1, 0), k)
    ready = a ** (k + 1) + runner_up_hits * (1.0 - a**covered)
    batch_ms = (k + 1) * draft_ms_per_token * batch_cost
    return (
        verify_ms
        + ready * max(0.0, batch_ms - verify_ms)
        + (1.0 - ready) * (resync_ms + k * draft_ms_per_token)
    )


def multi_outcome_ceiling(
    a: float, round_ms: dict[int, float], draft_ms_per_token: float, resync_ms: float,
    lines: int, runner_up_hits: float, batch_cost: float = 1.0,
) -> Ceiling | None:  # fmt: skip
    """max over k of E(k)/T(k), with T from `multi_outcome_round_ms`."""
    best = None
    for k, ms in round_ms.items():
        if ms and ms > 0:
            total = multi_outcome_round_ms(
                a, int(k), ms, draft_ms_per_token, resync_ms, lines, runner_up_hits, batch_cost
            )
            speed = 1e3 * expected_tokens_per_round(a, k) / total
            if best is None or speed > best.tokens_per_s:
                best = Ceiling(speed, int(k))
    return best


def ideal_ceiling(a: float, round_ms: dict[int, float]) -> Ceiling | None:
    """max over k of E(k)/t_v(k): a free draft, the stock API's absolute limit."""
    best = None
    for k, ms in round_ms.items():
        if ms and ms > 0:
            speed = 1e3 * expected_tokens_per_round(a, k) / ms
            if best is None or speed > best.tokens_per_s:
                best = Ceiling(speed, int(k))
    return best


def overlap_ceiling(
    a: float, round_ms: dict[int, float], draft_ms_per_token: float, resync_ms: float = 0.0
) -> Ceiling | None:
    """max over k of E(k)/T(k), with T from `overlap_round_ms`."""
    best = None
    for k, ms in round_ms.items():
        if ms and ms > 0:
            total = overlap_round_ms(a, int(k), ms, draft_ms_per_token, resync_ms)
            speed = 1e3 * expected_tokens_per_round(a, k) / total
            if best is None or speed > best.tokens_per_s:
                best = Ceiling(speed, int(k))
    return best


def acceptance_from_ratio(ratio: float, k: int) -> float:
    """The i.i.d. a whose accepted/drafted ratio at fixed k is `ratio`:
    (E(a, k) - 1) / k = ratio, solved by bisection (the ratio grows with a)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"acceptance ratio {ratio} outside [0, 1]")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_accepted_per_round(mid, k) / k < ratio:
            low = mid
        else:
            high = mid
    return (low + high) / 2
