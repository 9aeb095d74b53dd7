"""How many drafts each round sends: the cost model applied one position at a time.

Drafting and verifying position i adds P_i expected tokens to the round, where P_i
is the chance that drafts 1..i are all accepted. It costs the drafter's time for
one more token (what of it is not hidden behind verification) plus the growth of
the verify batch. A token is worth what the current rounds pay per token. So draft
position i while

    c * P_i * (round_ms / tokens_per_round)  >=  draft_ms_per_token + verify_ms_per_draft

P_i comes from the draft's own probabilities, scaled by c, the measured ratio of
accepted drafts to the sum of P_i (drafters are not calibrated: a random-weight or
quantised draft can be far too sure or too shy). All terms are running averages of
measured rounds; until a few rounds exist, every position up to k_max is drafted.
Position 1 is always drafted: a round without drafts is a plain step that still
pays the HTTP round trip.

Verification is not always linear in the draft length. On Vulkan a batch of up to 8
tokens takes the matrix-vector path and a larger one costs several times more, so the
k+1-slot round jumps between k = 2 and k = 3 (docs/BENCHMARKS.md, "Measurements behind
design choices"). The policy therefore keeps the mean verify time of each draft length
it has seen and charges position i the measured difference between lengths i and i-1
(the fitted slope where either is not measured yet), and it looks ahead: a costly
position is still drafted when the expected tokens of the following positions, with
the draft's per-token probability so far, repay it. With linear costs the look-ahead
changes nothing (each later position gains less and costs the same).

The formula only knows the verify time of lengths it has sent. Extrapolating with a
prior slope misjudges where verification grows faster than that (on a CPU every
prompt token costs; the k+1-prompt batch grows as k^2; on Strix Halo's Vulkan a round
past 8 tokens costs 3.4 steps instead of 1.3), and a policy that always sends one length
never learns the others. So from the first round the policy sweeps the lengths from
the shortest up, each a few times (`_SWEEP_SAMPLES`), and stops going longer once a
length is measured to lose more than `_SWEEP_STOP` of the best rate so far: on a cliff
the costly lengths are sent a few times, not for the rounds an unmeasured choice would
keep them. Between and beyond the lengths measured, the verify time follows the
measured curve (interpolated, extrapolated along its outermost segment), not a prior
slope. Later, every `_EXPLORE_EVERY` rounds, one round one draft longer or shorter than
its choice; a length measured to lose much is tried less often (up to 16 times less),
since each try costs what it loses.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Literal

import numpy as np

from proxy.running_mean import running_mean

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord

# uniform: one length, the k that maximises expected tokens per expected round time
# (see `round_ms_model`); formula: the same with two lengths where drafting ahead is on,
# one for rounds whose drafts are ready from drafting ahead and one for rounds that
# draft fresh (see `two_lengths`); marginal: the per-position rule above
LengthRule = Literal["formula", "uniform", "marginal"]
_FORMULA_RULES = ("formula", "uniform")

_ALPHA = 0.2  # weight of the newest round in the running averages
_PRIOR_VERIFY_SLOPE_MS = 1.0  # per extra draft, until measured (docs/BENCHMARKS.md)
_MIN_ROUNDS = 3  # rounds observed before the rule starts cutting drafts
_MIN_LENGTH_SAMPLES = 3  # rounds of one draft length before its mean verify time counts


_ACCEPT_ALPHA = 0.05  # the formula's acceptance: E(k) is steep in a, so average longer
_SWEEP_SAMPLES = 2  # rounds each length is sent by the first sweep
_SWEEP_STOP = 0.25  # the sweep goes no longer once a length loses this share of the best rate
_EXPLORE_EVERY = 16  # then one round beside the choice every so many rounds
_EXPLORE_SPACING_MAX = 16  # at most this many times rarer for what a neighbour loses a round
_EXPLORE_SETUP_SPACING_MAX = 64  # ... and for the slot copies its rounds waited for
# The free-drafter ceiling rules speculation out, so it takes the acceptance high: its
# Wilson bound this many standard errors up, and only after this many accepted drafts
# and rejections. On the Strix Halo 14B file (emulated), the point estimate after 7
# rounds (2 of 8 drafts accepted, a = 0.8 drawn) put the ceiling at 45 ms a token
# against a 42 ms step, and the defaults passed through at 1.00x where speculating
# ran 1.16x plain.
_CEILING_MIN_TRIALS = 16
_CEILING_Z = 1.0


def _ema(old: float | None, new: float, alpha: float = _ALPHA) -> float:
    return running_mean(old, new, alpha)


class DraftLengthPolicy:
    """Chooses each round's draft length (`decide`, then `worth` per position while
    drafting) from the rounds it observed (`observe`); shared by the requests of one
    proxy."""

    def __init__(self, k_max: int, adaptive: bool = True, rule: LengthRule = "formula") -> None:
        if rule not in ("formula", "uniform", "marginal"):
            raise ValueError(
                f"draft-length rule must be formula, uniform or marginal, not {rule!r}"
            )
        self.k_max = k_max
        self.adaptive = adaptive
        self.rule = rule
        self.rounds = 0
        # the formula's measurements: accepted drafts and rejections (running sums:
        # a = S / (S + F) is the per-draft acceptance of a geometric model, unbiased
        # where rounds end at their draft length), the drafter's own ms per fresh
        # token, the unhidden fixed cost of a re-synced round, the proxy's own time
        self._successes: float | None = None
        self._failures: float | None = None
        self._trials = 0  # accepted drafts and rejections observed, all told
        self.token_ms: float | None = None
        self.resync_ms: float | None = None
        self.proxy_ms: float | None = None
        self._best: int | None = None  # the formula's k, refreshed per observed round
        self._best_ahead = True
        self._two: tuple[int, int] | None = None  # the two-length formula's choice
        self.calibration = 1.0  # accepted / expected, running
        self._accepted: float | None = None
        self._expected: float | None = None
        self.round_ms: float | None = None
        self.tokens_per_round: float | None = None
        self.draft_ms_per_token: float | None = None
        self._verify: deque[tuple[int, float]] = deque(maxlen=64)
        self._by_length: dict[int, tuple[float, int]] = {}  # n -> (mean verify ms, rounds)
        self._slope = _PRIOR_VERIFY_SLOPE_MS
        self.prompts_per_round: float | None = None  # verify prompts (slots) per round
        self._explored: set[int] = set()  # round indexes `decide` chose to measure a length
        # what the last exploring round waited for its slots to be ready (a saved copy
        # restored into a slot a longer round uses)
        self._explore_setup_ms = 0.0
        self._explore_setup_round = -1

    def decide(self, ahead: bool, upcoming: int = 0) -> tuple[int, int]:
        """(the most drafts the next round should send, the most where it drafts them
        fresh), for rounds that draft ahead or not. `upcoming` 1: for the round after
        the one in progress (an early draft, drafting ahead), which must get the same
        answer as that round will when it starts."""
        return self.decide_at(ahead, self.rounds + upcoming)

    def decide_at(self, ahead: bool, round_index: int) -> tuple[int, int]:
        """`decide` for the round `round_index` (counted in observed rounds)."""
        explored = self.exploring(ahead, round_index)
        if explored is not None:
            self._explored.add(round_index)
            return explored, explored
        return self.length(ahead), self.fresh_length(ahead)

    def exploring_now(self) -> bool:
        """The round about to be observed was sent at a length chosen to measure it,
        not at the formula's choice: what it cost says little about speculation at its
        best (the plain-run gate does not judge by it)."""
        return self.rounds in self._explored

    def exploring(self, ahead: bool, round_index: int) -> int | None:
        """A length to measure instead of the formula's choice in round `round_index`
        (counted in observed rounds): the first sweep (`_sweep_length`), then every
        `_EXPLORE_EVERY` rounds one draft longer or shorter than the choice, in turn."""
        if not self.adaptive or self.rule not in _FORMULA_RULES:
            return None
        if round_index < _MIN_ROUNDS + _SWEEP_SAMPLES * self.k_max:
            swept = self._sweep_length(ahead)
            if swept is not None:
                return swept
        if round_index < _MIN_ROUNDS or round_index % _EXPLORE_EVERY:
            return None
        chosen = self.length(ahead)
        step = 1 if (round_index // _EXPLORE_EVERY) % 2 else -1
        neighbour = chosen + step if 1 <= chosen + step <= self.k_max else chosen - step
        neighbour = min(max(neighbour, 1), self.k_max)
        # a neighbour measured to lose much is tried less often: each such round costs
        # what it loses (a 9-token Vulkan round costs 3.4 steps instead of 1.2)
        if round_index % (_EXPLORE_EVERY * self._explore_spacing(ahead, chosen, neighbour)):
            return None
        return neighbour

    def _sweep_length(self, ahead: bool) -> int | None:
        """The shortest length not yet sent `_SWEEP_SAMPLES` times, unless the longest
        one measured already loses more than `_SWEEP_STOP` of the best measured rate
        (the curve only gets steeper past a cost cliff); None when the sweep is over."""
        rates: dict[int, float] = {}
        for n in range(1, self.k_max + 1):
            if self._by_length.get(n, (0.0, 0))[1] < _SWEEP_SAMPLES:
                if rates and rates[n - 1] < (1.0 - _SWEEP_STOP) * max(rates.values()):
                    return None
                return n
            rates[n] = self.expected_tokens(n) / max(self.round_ms_model(n, ahead), 1e-6)
        return None

    def _explore_spacing(self, ahead: bool, chosen: int, other: int) -> int:
        """How many exploring slots to skip between tries of `other`: 1, plus one per
        2.5% of expected rate it was measured to lose against `chosen`, plus one per
        2.5% of a round that exploring rounds waited for slot copies (at most 16, or 64
        with such copies). On the Strix Halo 14B chats a try of k = 2 about once a
        turn first restored a slot, 129-237 ms of ~60 ms rounds as the context grew
        (docs/BENCHMARKS.md, "Explorations that wait for a slot copy")."""
        if other == chosen:
            return 1
        rate = {
            n: self.expected_tokens(n) / max(self.round_ms_model(n, ahead), 1e-6)
            for n in (chosen, other)
        }
        regret = max(0.0, 1.0 - rate[other] / max(rate[chosen], 1e-9))
        round_ms = self.round_ms
        waited = int(self._explore_setup_ms / round_ms * 40) if round_ms else 0
        cap = _EXPLORE_SETUP_SPACING_MAX if waited else _EXPLORE_SPACING_MAX
        return 1 + min(cap - 1, int(regret * 40) + waited)

    def length(self, ahead: bool) -> int:
        """The most drafts the next round should send: k_max until measured, or in
        fixed-k and marginal modes (where `worth` cuts per position); else the
        formula's best length for drafting ahead on or off (with two lengths: the one
        for rounds whose drafts were drafted ahead, which drafting ahead aims for)."""
        if not self.adaptive or self.rule not in _FORMULA_RULES or self.rounds < _MIN_ROUNDS:
            return self.k_max
        if self.rule == "formula" and ahead:
            return self.two_lengths()[0]
        return self.best_length(ahead)

    def fresh_length(self, ahead: bool) -> int:
        """The most drafts of a round that drafts them fresh (no line drafted ahead
        holds its committed sequence): `length` except with two lengths."""
        if self.rule == "formula" and ahead and self.adaptive and self.rounds >= _MIN_ROUNDS:
            return self.two_lengths()[1]
        return self.length(ahead)

    def two_lengths(self) -> tuple[int, int]:
        """(k_ready, k_fresh) maximising the long-run tokens per ms of a two-state chain.

        A round whose drafts were drafted ahead (state R) pays verify(k_R) only; a
        round that drafts fresh (state M) also pays t_resync + k_M t_d. From either
        state the next round is in R when all k drafts and the bonus guess are
        accepted (chance p_s = a^(k_s+1)), else in M; a round in R waits for what
        drafting k_R + 1 tokens ahead took beyond the verification before it. With
        pi_R = p_M / (1 - p_R + p_M) the rate is

            (pi_R E(k_R) + pi_M E(k_M)) / (pi_R T_R + pi_M T_M)

        With k_R = k_M it is the one-length formula; a slow drafter gains by drafting
        few tokens fresh and many where they are ready."""
        if self._two is not None:
            return self._two
        a = self.acceptance_rate() or 0.0
        t_d = self.token_ms or 0.0
        proxy = self.proxy_ms or 0.0
        ks = range(1, self.k_max + 1)
        tokens = {k: self.expected_tokens(k) for k in ks}
        verify = {k: self.verify_ms_at(k) for k in ks}
        fresh = {k: max((self.resync_ms or 0.0) + k * t_d, 0.0) for k in ks}
        best, best_rate = (1, 1), -1.0
        for k_r in ks:
            for k_m in ks:
                p_r, p_m = a ** (k_r + 1), a ** (k_m + 1)
                # a hit after a round of k waits for drafting k_r + 1 ahead beyond verify(k)
                t_r = proxy + verify[k_r] + p_r * max(0.0, (k_r + 1) * t_d - verify[k_r])
                t_m = (
                    proxy + verify[k_m] + fresh[k_m]
                    + p_m * max(0.0, (k_r + 1) * t_d - verify[k_m])
                )  # fmt: skip
                pi_r = p_m / max(1.0 - p_r + p_m, 1e-9)
                rate = (pi_r * tokens[k_r] + (1 - pi_r) * tokens[k_m]) / max(
                    pi_r * t_r + (1 - pi_r) * t_m, 1e-6
                )
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = (k_r, k_m), rate
        self._two = best
        return best

    def acceptance_rate(self) -> float | None:
        """Per-draft acceptance a = accepted / (accepted + rejections)."""
        if self._successes is None or self._failures is None:
            return None
        return self._successes / max(self._successes + self._failures, 1e-9)

    def round_ms_model(self, k: int, ahead: bool, a: float | None = None) -> float:
        """Expected time of a round of k drafts (the cost model, proxy/bench/costmodel.py):

            verify(k) + proxy + (1 - a^(k+1)) (t_resync + k t_d)            ahead
            verify(k) + proxy + t_resync + k t_d                            serial

        Drafting ahead hides the next block when all k drafts and the bonus guess
        are accepted (chance a^(k+1)); then only what drafting k+1 tokens takes
        beyond the verification is paid. `a`: the measured acceptance unless given."""
        a = (self.acceptance_rate() if a is None else a) or 0.0
        t_d = self.token_ms or 0.0
        fixed = self.verify_ms_at(k) + (self.proxy_ms or 0.0)
        fresh = max((self.resync_ms or 0.0) + k * t_d, 0.0)  # what a miss leaves unhidden
        if not ahead:
            return fixed + fresh
        hit = a ** (k + 1)
        unhidden_on_hit = max(0.0, (k + 1) * t_d - self.verify_ms_at(k))
        return fixed + hit * unhidden_on_hit + (1.0 - hit) * fresh

    def expected_tokens(self, k: int, a: float | None = None) -> float:
        """E(k) = (1 - a^(k+1)) / (1 - a): accepted drafts plus the server's token (a:
        the measured acceptance unless given)."""
        a = min((self.acceptance_rate() if a is None else a) or 0.0, 0.999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def speedup_at(self, a: float, baseline: float) -> float | None:
        """How many times faster a token of speculation would come at per-draft
        acceptance `a` than at `baseline`, on the cost model with the verify times and
        drafter speed measured so far (best k for each, as the rounds drafted ahead or
        not); None before a round measured them. The plain-run gate scales the
        speculation rate it measured at `baseline` by it, to judge the acceptance of
        drafts checked beside plain runs (`PlainRunGate`, its shadow checks)."""
        if not self._by_length:
            return None
        ahead = self._best_ahead

        def rate(acceptance: float) -> float:
            return max(
                self.expected_tokens(k, acceptance)
                / max(self.round_ms_model(k, ahead, acceptance), 1e-6)
                for k in range(1, self.k_max + 1)
            )

        return rate(a) / max(rate(baseline), 1e-12)

    def optimistic_acceptance(self) -> float | None:
        """The measured acceptance taken high (its Wilson bound `_CEILING_Z` standard
        errors up, over the accepted drafts and rejections seen); None before
        `_CEILING_MIN_TRIALS` of them."""
        a, n = self.acceptance_rate(), self._trials
        if a is None or n < _CEILING_MIN_TRIALS:
            return None
        z2 = _CEILING_Z * _CEILING_Z
        centre = a + z2 / (2 * n)
        margin = _CEILING_Z * float(np.sqrt(a * (1 - a) / n + z2 / (4 * n * n)))
        return min((centre + margin) / (1 + z2 / n), 0.999)

    def best_length(self, ahead: bool) -> int:
        """argmax over 1..k_max of E(k) / T(k) (the shorter k on a tie)."""
        if self._best is not None and ahead == self._best_ahead:
            return self._best
        best, best_rate = 1, -1.0
        for k in range(1, self.k_max + 1):
            rate = self.expected_tokens(k) / max(self.round_ms_model(k, ahead), 1e-6)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        self._best, self._best_ahead = best, ahead
        return best

    def ceiling_ms_per_token(self) -> float | None:
        """The least ms per committed token a free drafter could reach on the verify
        times measured here: min over the measured lengths k of verify(k) / E(k), drafts
        costing nothing and hidden (the bench's `ideal`), at the acceptance taken high
        (`optimistic_acceptance`: it rules speculation out). None before enough drafts
        were judged, or while the first sweep has lengths left to measure (a longer one
        may be cheaper per token). On the H200 at 4k it is ~11-14 ms a token against a
        9.7 ms plain step: speculation cannot win there at any drafter speed."""
        a = self.optimistic_acceptance()
        if a is None:
            return None
        if self.adaptive and self.rule in _FORMULA_RULES and self._sweep_length(True) is not None:
            return None
        known = {m: v for m, (v, c) in self._by_length.items() if c >= _SWEEP_SAMPLES}
        if not known:
            return None
        return min(v / self.expected_tokens(m, a) for m, v in known.items())

    def verify_ms_at(self, n: int) -> float:
        """Mean verify time of rounds with n drafts: measured where the sweep's samples
        exist; between measured lengths, interpolated; beyond them, extrapolated along
        the measured curve's outermost segment (the fitted slope where one length is
        measured). A prior slope would hide a cost cliff: on Strix Halo's Vulkan the
        k = 2 round costs twice the k = 1 round, not a millisecond more."""
        known = {m: v for m, (v, c) in self._by_length.items() if c >= _SWEEP_SAMPLES}
        if not known:
            known = {m: v for m, (v, _c) in self._by_length.items()}
        if not known:
            return 0.0
        if n in known:
            return known[n]
        below = [m for m in known if m < n]
        above = [m for m in known if m > n]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (n - lo) / (hi - lo)
        side = sorted(below or above, key=lambda m: abs(m - n))
        if len(side) >= 2:
            near, far = side[0], side[1]
            slope = max((known[near] - known[far]) / (near - far), 0.0)
        else:
            near, slope = side[0], self.verify_slope_ms()
        return max(known[near] + slope * (n - near), 0.0)

    def worth(self, position: int, cumulative_p: float) -> bool:
        """Draft position `position` (1-based), whose drafts so far have joint p?"""
        if position > self.k_max:
            return False
        if not self.adaptive or position == 1 or self.rounds < _MIN_ROUNDS:
            return True
        if self.rule in _FORMULA_RULES:  # the length was chosen before drafting (`length`)
            return True
        assert self.round_ms is not None and self.tokens_per_round is not None
        token_ms = self.round_ms / max(self.tokens_per_round, 1.0)
        p = min(1.0, self.calibration * cumulative_p)
        per_token = cumulative_p ** (1.0 / position)  # the draft's p per position so far
        draft_ms = self.draft_ms_per_token or 0.0
        gain = cost = 0.0
        for m in range(position, self.k_max + 1):  # draft on up to m: does it repay?
            gain += p * per_token ** (m - position) * token_ms
            cost += draft_ms + self.verify_ms_for_draft(m)
            if gain >= cost:
                return True
        return False

    def slots_to_copy(self) -> int:
        """Slots a new request's prefilled slot should be copied into: with it, as many
        as the rounds have been using; all k until that is measured. A slot not copied
        is copied before the first verify batch that needs it (`SlotCopies.warm_for`,
        restoring the file this copy saved), which is cheaper than copying it up front
        when few rounds reach it: a slot holds the whole context's KV (docs/BENCHMARKS.md,
        "Measurements behind design choices"), and a spare copy made up front lags
        behind by the time a longer round uses it, as one restored then would."""
        if not self.adaptive or self.prompts_per_round is None or self.rounds < _MIN_ROUNDS:
            return self.k_max
        return min(self.k_max, max(1, round(self.prompts_per_round) - 1))

    def verify_ms_for_draft(self, position: int) -> float:
        """What drafting position `position` adds to the verify round: the measured
        difference between the mean rounds of `position` and `position - 1` drafts,
        else the fitted slope."""
        longer = self._by_length.get(position)
        shorter = self._by_length.get(position - 1)
        if (
            longer is not None and shorter is not None
            and min(longer[1], shorter[1]) >= _MIN_LENGTH_SAMPLES
        ):  # fmt: skip
            return max(longer[0] - shorter[0], 0.0)
        return self.verify_slope_ms()

    def verify_slope_ms(self) -> float:
        """Extra verify time per extra draft (fitted once per observed round: the
        drafter asks for it at every position)."""
        return self._slope

    def _fit_slope(self) -> float:
        """Least squares over recent rounds when their draft lengths vary enough, else
        a prior."""
        if len(self._verify) >= 8:
            ks = np.array([k for k, _ in self._verify], dtype=np.float64)
            ms = np.array([v for _, v in self._verify], dtype=np.float64)
            if ks.var() >= 0.25:
                slope = float(np.cov(ks, ms, bias=True)[0, 1] / ks.var())
                # at most a whole round's time per draft: a fixed cap (it was 20 ms)
                # hid the Strix Halo 32B's cliff, where one draft costs ~200 ms
                return min(max(slope, 0.0), float(ms.max()))
        return _PRIOR_VERIFY_SLOPE_MS

    def observe(self, record: RoundRecord, costs: bool = True) -> None:
        """A finished round. Only a steady verify round with the draft's p counts: a
        plain run has no draft, and the verify time of a first round (prefilling) or of
        one whose slots catch up (after plain runs, or copied for it) says nothing
        about the draft length, except where a fresh copy made its slots current before
        it (`refreshed`: the copy's time is left out of the round's and the proxy's).
        `costs` False: its acceptance counts, its times do not (a round padded to
        compare the shapes, `PaddingPolicy.trial`)."""
        probs = record.draft_probs
        n = len(probs)  # prompts - 1: what the verify time follows
        if self.exploring_now() and n and not (record.plain_run or record.first):
            # the last try's (its slots' lag, so its copy's cost, follows the context); a
            # try whose copy made it a catch-up round is sent again at the same index
            setup = max(record.verify_sent_ms - record.draft_ready_ms, 0.0)
            if self._explore_setup_round == self.rounds:
                setup = max(setup, self._explore_setup_ms)
            self._explore_setup_ms, self._explore_setup_round = setup, self.rounds
        if record.plain_run or record.first or (record.catch_up and not record.refreshed):
            return
        if not n:
            return
        expected = float(np.cumprod(np.asarray(probs, dtype=np.float64)).sum())
        self._accepted = _ema(self._accepted, record.n_accepted)
        self._expected = _ema(self._expected, expected)
        self.calibration = min(max((self._accepted + 0.1) / (self._expected + 0.1), 0.05), 4.0)
        if costs and not record.refreshed:
            self.round_ms = _ema(self.round_ms, record.round_ms)
            self.proxy_ms = _ema(self.proxy_ms, record.overhead_ms)
        self.tokens_per_round = _ema(self.tokens_per_round, record.n_committed)
        self.prompts_per_round = _ema(self.prompts_per_round, n + 1)
        self.draft_ms_per_token = _ema(self.draft_ms_per_token, record.draft_ms / n)
        if costs:
            self._observe_verify(n, record.verify_ms)
        rejected = record.n_accepted < n
        weight = max(1.0 / (self.rounds + 1), _ACCEPT_ALPHA)  # a plain mean at first
        self._successes = _ema(self._successes, record.n_accepted, weight)
        self._failures = _ema(self._failures, 1.0 if rejected else 0.0, weight)
        self._trials += record.n_accepted + (1 if rejected else 0)
        if record.fresh_tokens > 0:
            self.token_ms = _ema(self.token_ms, record.fresh_ms / record.fresh_tokens)
        if record.resynced:  # what the round waited for beyond drafting its tokens
            # (negative where an early draft hid part of the drafting behind the proxy's
            # own work on the previous round)
            self.resync_ms = _ema(self.resync_ms, record.draft_ms - record.fresh_ms)
        self._best = self._two = None
        self.rounds += 1
        self._explored = {i for i in self._explored if i >= self.rounds}

    def _observe_verify(self, n: int, verify_ms: float) -> None:
        """The verify time of a round of n drafts: the slope fit and the per-length mean."""
        self._verify.append((n, verify_ms))
        self._slope = self._fit_slope()
        mean, count = self._by_length.get(n, (verify_ms, 0))
        self._by_length[n] = (mean + (verify_ms - mean) / min(count + 1, 16), count + 1)

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "rounds": self.rounds,
            "calibration": self.calibration,
            "round_ms": self.round_ms,
            "tokens_per_round": self.tokens_per_round,
            "draft_ms_per_token": self.draft_ms_per_token,
            "verify_ms_per_draft": self.verify_slope_ms(),
            "rule": self.rule,
            "acceptance": self.acceptance_rate(),
            "draft_token_ms": self.token_ms,
            "resync_ms": self.resync_ms,
            "formula_k_ahead": self.length(True) if self.rounds else None,
            "formula_k_fresh": self.fresh_length(True) if self.rounds else None,
            "formula_k_serial": self.best_length(False) if self.rounds else None,
        }
