"""Speculate or let the server decode alone: whichever the measurements say is faster.

Through the stock HTTP API a verify round costs about two plain decode steps on a GPU,
more at long contexts (docs/BENCHMARKS.md, "Summary"). With a drafter that is slow or
often wrong, every round the proxy sends loses to llama-server's own decoding loop, so
the proxy would be slower than the server it fronts. A *plain run* asks the server for
`run_tokens` tokens of the same context in one request (its own loop, one decode per
token): lossless, since that is exactly what llama-server alone would write (greedy),
or draw (sampling, with the request's chain).

The gate compares two measured rates, pooled over recent samples:

- speculation: wall ms per committed token of steady rounds (drafting, verifying and
  the proxy's own work; not the first round after a plain run, whose other slots catch
  up on the run's tokens);
- plain runs: wall ms per token of recent runs (the request's HTTP and prompt
  matching included).

Speculation is also charged what a cold request pays before its steady rounds (the
slot copies of its first rounds), spread over the measured length of a request. A
request that passes through pays none of it, so where steady rounds barely beat plain
runs the fill decides (H200, 512 tokens, 14B f16: ~210 ms a request, 1.6 ms a token of
a 128-token answer).

It starts with plain runs, which cost nothing against llama-server alone, while the
drafter drafts once beside them to time itself; then it speculates for a few rounds
(only now are the slots the rounds use filled with the context), then keeps the
cheaper side (switching needs a `HYSTERESIS` lead) and re-measures the other side now
and then, so a drafter that becomes worth it (another prompt, a warmer cache) wins
back. Re-measuring speculation is the dear direction: the slots it uses must catch up
on the runs' tokens (or, in a new request, prefill its whole prompt, which at long
contexts costs over a hundred plain steps; docs/BENCHMARKS.md). So each
re-measurement that confirms plain runs doubles the wait for the next, and the wait
is at least long enough that what the last one lost (its rounds' time beyond what
plain runs would have taken for the same tokens) stays under `PROBE_BUDGET` of the
plain time in between. One gate is shared by the requests of one proxy, like the
draft-length policy.

A drafter too slow to ever win is told apart without those rounds. A round of k
drafts takes at least one plain step and at least k of the drafter's tokens (drafting
ahead hides drafting behind verification, it does not make it faster), and it commits
at most k + 1 tokens; where that bound is no cheaper than plain runs, the gate stays
with plain runs without a single speculative round, and no slot copy is made (at long
contexts copies cost seconds: a slot holds the whole context's KV).

While plain runs are chosen, whole requests pass through to llama-server untouched
(its own streaming, no per-run requests); every so many requests one is served by
the engine again, which re-measures both sides.

A re-measurement that only confirms plain runs is pure loss, and a dear one: on the
H200 (14B f16) a chat's third turn paid 463 ms of slot copies at 1,357 tokens and ran
0.81x plain, which held the whole chat at 0.95x (docs/BENCHMARKS.md). What can make
speculation win where it lost is mostly the drafter's acceptance (another prompt,
another kind of text), and that is measured beside plain runs: in the last
`SHADOW_RUNS` runs before a re-measurement is due, the drafter drafts beside each run
and its draft is checked against the run's tokens, exactly as a round would have
accepted it (greedy). On an NPU that costs the server nothing; a drafter that shares
the server's processor slows the runs beside it, which then do not count as plain
speed (`_observe_run`). The measured speculation rate, scaled by the
cost model to that acceptance (`DraftLengthPolicy.speedup_at`), then decides: only
where it now beats plain runs is speculation re-measured with real rounds; otherwise
the re-measurement is skipped and the wait doubles as if it had confirmed plain runs.
After `SHADOW_SKIPS_MAX` skips in a row the next one is made anyway: what the shadow
checks cannot see (a shorter context, a less busy server) changes the rate too.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Literal, Protocol

from proxy.running_mean import running_mean

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord

log = logging.getLogger(__name__)

RunMode = Literal["auto", "off"]

MIN_SPEC_ROUNDS = 6  # speculative rounds measured before the first plain run
# steady rounds the speculation rate pools. At one draft a round (1 or 2 tokens each) 8
# rounds gave a rate within +-15%, and the gate, judging every round, met a window 30%
# slow by chance: on the Strix Halo 14B file (emulated) a 400-token warm-up chose plain
# runs ("46.3 ms/token vs plain 42.2") where speculation ran ~35 ms a token
SPEC_WINDOW = 24
HYSTERESIS = 0.05  # the other side must be this much cheaper per token to switch
PROBE_SPEC_AFTER = 256  # plain-run tokens before speculation is first re-measured
PROBE_SPEC_AFTER_MAX = 4096  # the interval doubles while re-measurements confirm plain
PROBE_BUDGET = 0.05  # a re-measurement may cost this share of the plain time until the next
PROBE_SPEC_AFTER_CAP = 65536  # the longest wait, however dear a re-measurement was
PROBE_SPEC_ROUNDS = 4  # rounds of speculation each re-measurement runs
PROBE_PLAIN_AFTER = 512  # committed speculative tokens before plain runs are re-measured
PROBE_PLAIN_AFTER_MAX = 4096  # the wait doubles while re-measurements find speculation
PROBE_PLAIN_LEAD = 2 * HYSTERESIS  # ... at least this much cheaper per token than plain runs
PASS_REQUESTS = 4  # requests passed through before one re-measures (while plain is chosen)
PASS_REQUESTS_MAX = 64  # doubling while re-measurements confirm plain runs
BOUND_K_MAX = 16  # draft lengths the drafter-speed bound considers
SHADOW_RUNS = 8  # plain runs before a due re-measurement that the drafter drafts beside
SHADOW_MIN_DRAFTS = 6  # drafts checked beside runs before the checks may skip a re-measurement
SHADOW_SKIPS_MAX = 3  # re-measurements skipped in a row before one is made anyway
_COLD_ALPHA = 0.3  # weight of the newest request in the cold cost and the request length
_DRAFT_ALPHA = 0.3  # weight of the newest drafter timing


class ShadowModel(Protocol):
    """What the shadow checks judge by (`DraftLengthPolicy`): the per-draft acceptance
    the rounds measure, and how much faster speculation is at one acceptance than at
    another on the measured costs."""

    def acceptance_rate(self) -> float | None: ...

    def speedup_at(self, a: float, baseline: float) -> float | None: ...


def speculation_bound_ms(plain_ms: float, draft_ms: float, k_max: int = BOUND_K_MAX) -> float:
    """The least ms per committed token speculation can reach with a drafter of
    `draft_ms` per token: a round of k drafts lasts at least one plain step and k
    drafter tokens, and commits at most k + 1 tokens (all accepted plus the bonus)."""
    return min(max(plain_ms, k * draft_ms) / (k + 1) for k in range(1, k_max + 1))


class _Rate:
    """ms per token pooled over the last `size` samples."""

    def __init__(self, size: int) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=size)

    def add(self, ms: float, tokens: int) -> None:
        if tokens > 0:
            self._samples.append((ms, tokens))

    def clear(self) -> None:
        self._samples.clear()

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def ms_per_token(self) -> float | None:
        tokens = sum(t for _, t in self._samples)
        return sum(ms for ms, _ in self._samples) / tokens if tokens else None


class PlainRunGate:
    """Before each round (`decide`): 0 to speculate, n > 0 for a plain run of n tokens;
    after it (`observe`): what it cost. One gate per kind of request (greedy, unseeded
    sampling): their rounds cost differently."""

    def __init__(
        self,
        mode: RunMode = "auto",
        run_tokens: int = 16,
        name: str = "greedy",
        model: ShadowModel | None = None,
    ) -> None:
        if run_tokens < 1:
            raise ValueError("run_tokens must be >= 1")
        self.mode = mode
        self.name = name  # which requests the gate serves, for its log lines
        self.run_tokens = run_tokens
        self._spec = _Rate(SPEC_WINDOW)
        self._plain = _Rate(4)
        self.plain_chosen = False
        self._spec_probe_left = 0  # speculative rounds a re-measurement still has to see
        # A re-measurement costs more than its rounds: the slots it uses catch up on
        # every token the runs wrote. Each one that confirms plain runs doubles the wait.
        self._probe_spec_after = PROBE_SPEC_AFTER
        self._plain_tokens_since_probe = 0
        # Re-measuring plain runs costs speculation too: on the Strix Halo 14B (emulated)
        # each 16-token run and the catch-up round after it lost ~335 ms, 2.4% of a
        # 400-token chat turn (docs/BENCHMARKS.md, "Plain runs re-measured less often").
        # Each one that finds speculation clearly ahead doubles the wait.
        self._probe_plain_after = PROBE_PLAIN_AFTER
        self._spec_tokens_since_probe = 0
        self._probe_loss_ms = 0.0  # what the current re-measurement cost beyond plain runs
        self.switches = 0
        self.draft_ms: float | None = None  # the drafter's own ms per drafted token
        self._passed = 0  # requests passed through since the last re-measuring one
        self._pass_limit = PASS_REQUESTS
        # What a cold request pays before its steady rounds (the slot copies and the
        # proxy's work in its first and catch-up rounds), running over requests; the one
        # in progress; and the tokens a request served here writes
        self.cold_ms: float | None = None
        self._cold_pending: float | None = None
        self.request_tokens: float | None = None
        # Shadow checks (greedy only): the cost model that scales the speculation rate
        # to an acceptance (None: no shadow checks), the acceptance measured when the
        # speculation rate was (the model's, at the last steady round), the accepted
        # drafts, rejections and drafts seen beside the runs since the last due
        # re-measurement (`_shadow_window` counts those), the re-measurements skipped in
        # a row, and what the last check saw
        self.model = model
        self._spec_acceptance: float | None = None
        self._shadow_window = 0
        self._shadow_accepted = 0
        self._shadow_rejected = 0
        self._shadow_drafts = 0
        self._shadow_skips = 0
        self._shadow_extended = False  # the due point was put off once for more checks
        self.shadow_acceptance: float | None = None
        self.shadow_skipped = 0  # re-measurements skipped, all told

    def decide(self) -> int:
        if self.mode == "off" or self._spec_probe_left > 0:
            return 0
        if self.measuring_first():
            # before any slot copy: plain runs are measured first, and the drafter's
            # speed beside them, which may rule speculation out at no cost
            return self.run_tokens
        if self.plain_chosen:
            if self._plain_tokens_since_probe >= self._probe_spec_after:
                if self._shadow_put_off():
                    self._plain_tokens_since_probe -= SHADOW_RUNS * self.run_tokens
                    return self.run_tokens
                self._plain_tokens_since_probe = 0
                if self._shadow_says_plain():
                    self._probe_spec_after = self._next_probe_wait()
                    return self.run_tokens
                # re-measure speculation afresh: its old rounds may be long stale
                self._spec.clear()
                self._spec_probe_left = PROBE_SPEC_ROUNDS
                self._probe_loss_ms = 0.0
                return 0
            return self.run_tokens
        if self._spec_tokens_since_probe >= self._probe_plain_after:
            return self.run_tokens
        return 0

    def prefers_plain(self) -> bool:
        """Plain runs are the measured choice right now."""
        return self.mode != "off" and self.plain_chosen

    def wants_shadow(self) -> bool:
        """The next plain run should have a draft beside it, checked against its tokens:
        a re-measurement is due within `SHADOW_RUNS` runs and there is a measured
        speculation rate to scale."""
        return (
            self.model is not None
            and self.prefers_plain()
            and self._spec_probe_left == 0
            and self._spec.ms_per_token is not None
            and self._plain_tokens_since_probe + SHADOW_RUNS * self.run_tokens
            >= self._probe_spec_after
        )

    @property
    def shadow_window(self) -> int:
        """Which due re-measurement the shadow checks made now count for: a draft
        judged after that one was decided (`observe_shadow`) is dropped."""
        return self._shadow_window

    def observe_shadow(self, n_accepted: int, rejected: bool, window: int) -> None:
        """A draft beside a plain run, started in `window` (`shadow_window`), had its
        first `n_accepted` tokens equal to the run's, and then one that differed
        (`rejected`) or none left to compare."""
        if window != self._shadow_window:
            return  # judged after its re-measurement was decided
        self._shadow_accepted += n_accepted
        self._shadow_rejected += int(rejected)
        self._shadow_drafts += 1

    def _shadow_put_off(self) -> bool:
        """At a due re-measurement with shadow checks under way but fewer than
        `SHADOW_MIN_DRAFTS` judged (a drafter slower than the runs drafts beside every
        other one, a draft still running when its run ended is judged later): the checks
        get `SHADOW_RUNS` more runs, once, before the gate decides. Returns whether it
        put the due point off (and records that it did)."""
        if self._shadow_extended or self._shadow_drafts >= SHADOW_MIN_DRAFTS:
            return False
        if self.model is None or self._spec.ms_per_token is None:
            return False  # no checks were made: nothing to wait for
        self._shadow_extended = True
        return True

    def _shadow_says_plain(self) -> bool:
        """At a due re-measurement: whether the shadow checks since the last one predict
        that speculation still loses (the re-measurement is then skipped). Too few
        drafts checked, no rate to scale, or `SHADOW_SKIPS_MAX` skips in a row:
        re-measure."""
        accepted, rejected, drafts = (
            self._shadow_accepted, self._shadow_rejected, self._shadow_drafts
        )  # fmt: skip
        self._shadow_accepted = self._shadow_rejected = self._shadow_drafts = 0
        self._shadow_window += 1
        self._shadow_extended = False
        if accepted + rejected:
            self.shadow_acceptance = accepted / (accepted + rejected)
        predicted = None
        if drafts >= SHADOW_MIN_DRAFTS and accepted + rejected:
            predicted = self._predicted_spec_ms(accepted / (accepted + rejected))
        plain = self._plain.ms_per_token
        skip = (
            predicted is not None and plain is not None
            and predicted >= plain * (1 - HYSTERESIS) and self._shadow_skips < SHADOW_SKIPS_MAX
        )  # fmt: skip
        if predicted is not None and plain is not None:
            log.info(
                "%s requests: drafts beside plain runs accepted %.2f: speculating would take "
                "%.1f ms/token vs plain %.1f; %s", self.name, self.shadow_acceptance, predicted,
                plain, "re-measurement skipped" if skip else "re-measuring it",
            )  # fmt: skip
        self._shadow_skips = self._shadow_skips + 1 if skip else 0
        self.shadow_skipped += int(skip)
        return skip

    def _predicted_spec_ms(self, a: float) -> float | None:
        """The measured speculation rate scaled by the cost model to acceptance `a`,
        with the cold fill charge; None without a model, a rate or its acceptance."""
        spec, baseline = self._spec.ms_per_token, self._spec_acceptance
        if self.model is None or spec is None or baseline is None:
            return None
        factor = self.model.speedup_at(a, baseline)
        if factor is None or factor <= 0:
            return None
        return spec / factor + self.cold_ms_per_token()

    def measuring_first(self) -> bool:
        """Nothing is known yet that could justify speculating: no plain run measured,
        or no drafter speed (it is timed while the first plain runs decode) and no
        speculative round. A generation then fills one slot and copies none."""
        if self.mode == "off" or self.plain_chosen:
            return False
        return self._plain.ms_per_token is None or (self.draft_ms is None and not self._spec)

    def wants_drafter_speed(self) -> bool:
        """The gate waits for the drafter's speed before speculating."""
        return self.mode != "off" and self.draft_ms is None

    def observe(
        self, record: RoundRecord, exploring: bool = False, ceiling_ms: float | None = None
    ) -> None:
        """One round of a generation: a plain run, or a speculative round that measures
        speculation (steady) or that catches the slots up on the runs' tokens (the first
        round of a generation prefills its prompt: no rate at all), and in every
        speculative round the drafter's own speed, which tells a drafter too slow to win
        apart. `exploring`: the draft-length policy sent the round at a length it
        measures, not at its choice; like a catch-up round it is part of what a
        re-measurement costs, not a speculation speed. `ceiling_ms`: the least ms per
        token a free drafter could reach on the verify times measured so far
        (`DraftLengthPolicy.ceiling_ms_per_token`); where that loses to plain runs, plain
        runs are chosen without waiting for steady rounds."""
        if record.plain_run:
            self._observe_run(record.verify_ms, record.n_run_tokens, record.drafter_busy)
            return
        self._observe_cold(record, exploring)
        if record.catch_up or exploring:
            self._observe_catch_up(record.round_ms, record.n_committed)
        elif not record.first:
            self._observe_round(record.round_ms, record.n_committed)
        if record.fresh_tokens > 0:
            self.observe_drafter(record.fresh_ms / record.fresh_tokens)
        if ceiling_ms is not None:
            self._rule_out_by_ceiling(ceiling_ms)

    def _observe_cold(self, record: RoundRecord, exploring: bool) -> None:
        """A cold request's cost before its steady rounds: the proxy's own time (slot
        copies above all) in its first round and the catch-up rounds after it, summed
        until its first steady round."""
        if record.first:
            self._cold_pending = record.overhead_ms
        elif record.catch_up and self._cold_pending is not None:
            self._cold_pending += max(record.overhead_ms, self._catch_up_excess(record))
        elif not exploring and self._cold_pending is not None:
            self.cold_ms = running_mean(self.cold_ms, self._cold_pending, _COLD_ALPHA)
            self._cold_pending = None

    def _catch_up_excess(self, record: RoundRecord) -> float:
        """What a catch-up round cost beyond a steady round committing as many tokens
        (0 before any steady round): where no copy was worth making, its slots prefilled
        what they lacked inside its batch, and that is part of the cold cost as a copy's
        time in the proxy's overhead is (`SlotReplicator.copy_pays`)."""
        rate = self._spec.ms_per_token
        return 0.0 if rate is None else record.round_ms - record.n_committed * rate

    def observe_request(self, n_tokens: int) -> None:
        """A request served by the engine ended after writing `n_tokens`."""
        if n_tokens > 0:
            self.request_tokens = running_mean(self.request_tokens, float(n_tokens), _COLD_ALPHA)
            if len(self._spec) >= MIN_SPEC_ROUNDS:
                self._reconsider()

    def cold_ms_per_token(self) -> float:
        """A cold request's measured cost spread over a request's measured length (none
        before a request ended: nothing is assumed about how long answers are)."""
        if self.cold_ms is None or not self.request_tokens:
            return 0.0
        return self.cold_ms / self.request_tokens

    def _rule_out_by_ceiling(self, ceiling_ms: float) -> None:
        """Plain runs where even a free drafter loses on the measured verify times (the
        usual re-measurements follow: a verify time measured at other contexts may
        change). On the H200 at 4k this decides within the first request's sweep, where
        steady rounds at the formula's length (after 15 exploring ones) came only in
        the next request, which then speculated at 0.43x plain."""
        plain = self._plain.ms_per_token
        if self.plain_chosen or self.mode == "off" or plain is None:
            return
        if ceiling_ms * (1 - HYSTERESIS) >= plain:
            self._switch(
                f"a free drafter allows speculating no faster than {ceiling_ms:.1f} ms/token "
                f"on the measured verify rounds vs plain {plain:.1f} ms/token"
            )

    def hopeless(self) -> bool:
        """At the measured drafter speed speculation cannot beat plain runs, even with
        every draft accepted (`speculation_bound_ms`)."""
        plain = self._plain.ms_per_token
        if plain is None or self.draft_ms is None:
            return False
        return speculation_bound_ms(plain, self.draft_ms) * (1 - HYSTERESIS) >= plain

    def pass_through(self) -> bool:
        """Whether a new request should go to llama-server untouched: plain runs are
        chosen, and it is not the turn of a request that re-measures (one in
        `PASS_REQUESTS`, doubling up to `PASS_REQUESTS_MAX` while plain stays chosen)."""
        if not self.prefers_plain():
            return False
        if self._passed < self._pass_limit:
            self._passed += 1
            return True
        self._passed = 0
        self._pass_limit = min(2 * self._pass_limit, PASS_REQUESTS_MAX)
        return False

    def observe_drafter(self, ms_per_token: float) -> None:
        """The drafter's own time per drafted token (re-syncs excluded), from a round or
        from a draft timed beside a plain run."""
        if ms_per_token <= 0:
            return
        self.draft_ms = running_mean(self.draft_ms, ms_per_token, _DRAFT_ALPHA)
        if self._spec_probe_left > 0 and self.hopeless():
            self._spec_probe_left = 0  # no need to finish a re-measurement that cannot win
            self._probe_spec_after = self._next_probe_wait()
        self._rule_out_if_hopeless()

    def _rule_out_if_hopeless(self) -> bool:
        """Plain runs for good where the drafter's speed cannot win (before any round);
        whether it switched to them now."""
        if self.plain_chosen or not self.hopeless():
            return False
        assert self.draft_ms is not None and self._plain.ms_per_token is not None
        bound = speculation_bound_ms(self._plain.ms_per_token, self.draft_ms)
        self._switch(
            f"drafting {self.draft_ms:.1f} ms/token allows speculating no faster than "
            f"{bound:.1f} ms/token vs plain {self._plain.ms_per_token:.1f} ms/token"
        )
        return True

    def _observe_round(self, round_ms: float, n_committed: int) -> None:
        """A steady speculative round (not a first round, not one catching up a run)."""
        self._spec.add(round_ms, n_committed)
        if self.model is not None:
            self._spec_acceptance = self.model.acceptance_rate()
        self._spec_tokens_since_probe += n_committed
        if self._spec_probe_left > 0:
            self._count_probe_loss(round_ms, n_committed)
            self._spec_probe_left -= 1
            if self._spec_probe_left > 0:
                return  # judge the re-measurement once it is complete
            self._reconsider()
            if self.plain_chosen:
                self._probe_spec_after = self._next_probe_wait()
            return
        if len(self._spec) >= MIN_SPEC_ROUNDS:  # a plain run measured early waits for them
            self._reconsider()

    def _observe_catch_up(self, round_ms: float, n_committed: int) -> None:
        """The first speculative round after plain runs (the slots catch up on the runs'
        tokens), or one that slots were copied for. Not a speculation speed; part of
        what a re-measurement costs."""
        if self._spec_probe_left > 0:
            self._count_probe_loss(round_ms, n_committed)

    def _count_probe_loss(self, round_ms: float, n_committed: int) -> None:
        plain = self._plain.ms_per_token
        if plain is not None:
            self._probe_loss_ms += max(0.0, round_ms - n_committed * plain)

    def _next_probe_wait(self) -> int:
        """Plain-run tokens until the next re-measurement of speculation."""
        doubled = min(2 * self._probe_spec_after, PROBE_SPEC_AFTER_MAX)
        plain = self._plain.ms_per_token
        if not plain:
            return doubled
        affordable = int(self._probe_loss_ms / (PROBE_BUDGET * plain))
        return min(max(doubled, affordable), PROBE_SPEC_AFTER_CAP)

    def _observe_run(self, run_ms: float, n_tokens: int, drafter_busy: bool = False) -> None:
        """A plain run of n_tokens (all it wrote, also past where the output stopped).
        One beside the drafter's background work is no plain speed: a CPU drafter taking
        in a long context starves the server's host threads (on the H200's host, plain
        runs beside a 4k prefill measured 150 ms a token instead of 10), and a plain
        rate that slow let losing speculation look close to it."""
        if not drafter_busy:
            self._plain.add(run_ms, n_tokens)
        self._plain_tokens_since_probe += n_tokens
        self._spec_tokens_since_probe = 0
        if not self._rule_out_if_hopeless() and len(self._spec) >= MIN_SPEC_ROUNDS:
            self._reconsider()
            if not self.plain_chosen:  # a re-measurement that kept speculation
                self._probe_plain_after = self._next_plain_probe_wait()

    def _next_plain_probe_wait(self) -> int:
        """Speculative tokens until plain runs are re-measured again: twice the last
        wait where speculation (its cold cost included) stays `PROBE_PLAIN_LEAD` cheaper
        per token than the runs just measured, else the shortest. Speculation's rate is
        measured every round; within a conversation the context only grows, so a plain
        rate measured earlier is if anything too fast, which errs towards plain runs."""
        spec, plain = self._spec.ms_per_token, self._plain.ms_per_token
        if spec is None or plain is None:
            return PROBE_PLAIN_AFTER
        if spec + self.cold_ms_per_token() <= plain * (1 - PROBE_PLAIN_LEAD):
            return min(2 * self._probe_plain_after, PROBE_PLAIN_AFTER_MAX)
        return PROBE_PLAIN_AFTER

    def _reconsider(self) -> None:
        """Keep the cheaper side. Speculation is charged its steady rounds and the cold
        cost a request pays before them: on the H200 at 512 (14B f16) steady rounds ran
        within 3% of plain runs while each cold request's copies cost ~210 ms, 1.6 ms a
        token of a 128-token answer, and the defaults speculated through the warm-up
        and the next request (0.93x plain)."""
        spec, plain = self._spec.ms_per_token, self._plain.ms_per_token
        if spec is None or plain is None:
            return
        spec += self.cold_ms_per_token()
        if self.plain_chosen:
            switch = spec < plain * (1 - HYSTERESIS)
        else:
            switch = plain < spec * (1 - HYSTERESIS)
        if switch and not (self.plain_chosen and self.hopeless()):
            cold = self.cold_ms_per_token()
            part = f" ({cold:.1f} of it a cold request's slot fill)" if cold else ""
            self._switch(f"speculating {spec:.1f} ms/token{part} vs plain {plain:.1f} ms/token")

    def _switch(self, why: str) -> None:
        self.plain_chosen = not self.plain_chosen
        self.switches += 1
        self._probe_spec_after = PROBE_SPEC_AFTER
        self._probe_plain_after = PROBE_PLAIN_AFTER
        self._passed, self._pass_limit = 0, PASS_REQUESTS
        log.info(
            "%s requests: %s: %s",
            self.name, why, "plain runs" if self.plain_chosen else "speculating again",
        )  # fmt: skip

    def snapshot(self) -> dict[str, float | int | bool | None]:
        return {
            "plain_chosen": self.plain_chosen,
            "spec_ms_per_token": self._spec.ms_per_token,
            "plain_ms_per_token": self._plain.ms_per_token,
            "switches": self.switches,
            "probe_spec_after": self._probe_spec_after,
            "probe_plain_after": self._probe_plain_after,
            "draft_ms_per_token": self.draft_ms,
            "hopeless": self.hopeless(),
            "cold_ms": self.cold_ms,
            "request_tokens": self.request_tokens,
            "shadow_acceptance": self.shadow_acceptance,
            "shadow_skipped": self.shadow_skipped,
        }
