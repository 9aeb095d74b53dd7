"""The plain-run gate: measured choice between speculating and plain runs (no server)."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import replace

import pytest

from proxy.engine import RoundRecord
from proxy.policies.plain_runs import (
    MIN_SPEC_ROUNDS,
    PROBE_PLAIN_AFTER,
    PROBE_PLAIN_AFTER_MAX,
    PROBE_SPEC_AFTER,
    PROBE_SPEC_ROUNDS,
    PlainRunGate,
)


def steady(
    round_ms: float, n_committed: int, drafter_ms: float = 0.0, catch_up: bool = False
) -> RoundRecord:
    """A steady speculative round of round_ms that committed n tokens; with
    `drafter_ms`, the drafter drafted one token fresh in that time."""
    return RoundRecord(
        1, 0, n_committed, 0.0, 0.0, 0.0, round_ms=round_ms, catch_up=catch_up,
        fresh_tokens=1 if drafter_ms else 0, fresh_ms=drafter_ms,
    )  # fmt: skip


def catch_up(round_ms: float, n_committed: int, drafter_ms: float = 0.0) -> RoundRecord:
    """The first speculative round after plain runs."""
    return steady(round_ms, n_committed, drafter_ms, catch_up=True)


def plain_run(run_ms: float, n_tokens: int) -> RoundRecord:
    return RoundRecord(0, 0, n_tokens, 0.0, run_ms, 0.0, plain_run=True, n_run_tokens=n_tokens)


def begin(gate: PlainRunGate, plain_ms_per_token: float, drafter_ms: float = 2.0) -> None:
    """What every gate does first: one plain run, and the drafter's speed from a draft
    timed beside it, reported when that draft is done."""
    n = gate.run_tokens
    assert gate.measuring_first() and gate.decide() == n
    gate.observe(plain_run(n * plain_ms_per_token, n))
    gate.observe_drafter(drafter_ms)


def speculate(gate: PlainRunGate, rounds: int, ms_per_token: float, tokens: int = 3) -> None:
    for _ in range(rounds):
        assert gate.decide() == 0
        gate.observe(steady(ms_per_token * tokens, tokens))


def test_off_always_speculates():
    gate = PlainRunGate("off")
    for _ in range(50):
        assert gate.decide() == 0
        gate.observe(steady(100.0, 1))


def test_a_plain_run_first_then_a_few_rounds_then_the_cheaper_side_wins():
    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=10.0)
    assert not gate.measuring_first()
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    assert gate.plain_chosen
    assert gate.decide() == 16


def test_speculation_waits_for_the_drafter_speed():
    """Plain runs go on until the drafter, timed beside one of them, has reported: no
    slot is copied for speculation before that."""
    gate = PlainRunGate("auto", run_tokens=16)
    for _ in range(3):  # the timing draft is still running (a long prompt to take in)
        assert gate.decide() == 16
        gate.observe(plain_run(16 * 10.0, 16))
        assert gate.measuring_first() and gate.wants_drafter_speed()
    gate.observe_drafter(2.0)  # it reports, between two runs
    assert not gate.measuring_first() and not gate.wants_drafter_speed()
    assert gate.decide() == 0


def test_speculation_kept_when_cheaper_and_plain_re_measured_now_and_then():
    gate = PlainRunGate("auto", run_tokens=8)
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=5.0, tokens=4)
    assert not gate.plain_chosen
    # no plain run again until PROBE_PLAIN_AFTER speculative tokens were committed
    speculate(gate, PROBE_PLAIN_AFTER // 4 - MIN_SPEC_ROUNDS, ms_per_token=5.0, tokens=4)
    assert gate.decide() == 8
    gate.observe(plain_run(8 * 10.0, 8))
    assert not gate.plain_chosen


def spec_tokens_until_plain_run(gate: PlainRunGate, ms_per_token: float, tokens: int = 4) -> int:
    """Speculative tokens committed before the gate asks for a plain run again."""
    committed = 0
    while gate.decide() == 0:
        gate.observe(steady(ms_per_token * tokens, tokens))
        committed += tokens
    return committed


def test_plain_re_measured_less_often_while_speculation_stays_clearly_ahead():
    """Each re-measurement that finds speculation clearly cheaper doubles the wait for
    the next (up to PROBE_PLAIN_AFTER_MAX); one that finds the lead thin brings the
    shortest wait back."""
    gate = PlainRunGate("auto", run_tokens=8)
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=7.0, tokens=4)  # 30% cheaper
    waits = []
    for _ in range(5):
        waits.append(spec_tokens_until_plain_run(gate, ms_per_token=7.0))
        gate.observe(plain_run(8 * 10.0, 8))
        assert not gate.plain_chosen
    # the first wait counts the MIN_SPEC_ROUNDS rounds before it
    assert waits[0] == PROBE_PLAIN_AFTER - 4 * MIN_SPEC_ROUNDS
    assert waits[1:] == [2 * PROBE_PLAIN_AFTER, 4 * PROBE_PLAIN_AFTER, PROBE_PLAIN_AFTER_MAX,
                         PROBE_PLAIN_AFTER_MAX]  # fmt: skip
    # speculation got dearer (9.3 against 10 ms a token): kept, but no longer clearly ahead
    assert spec_tokens_until_plain_run(gate, ms_per_token=9.3) == PROBE_PLAIN_AFTER_MAX
    gate.observe(plain_run(8 * 10.0, 8))
    assert not gate.plain_chosen
    assert spec_tokens_until_plain_run(gate, ms_per_token=9.3) == PROBE_PLAIN_AFTER


def test_speculation_re_measured_while_plain_runs_win_and_can_win_back():
    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    assert gate.plain_chosen
    runs = 0
    while gate.decide() == 16:  # plain runs until speculation is due a re-measurement
        gate.observe(plain_run(160.0, 16))
        runs += 1
    assert runs * 16 + 16 >= PROBE_SPEC_AFTER  # ran at least that many plain tokens
    gate.observe(steady(4 * 3.0, 4))  # speculation got much cheaper (another prompt)
    for _ in range(PROBE_SPEC_ROUNDS - 2):
        assert gate.plain_chosen  # judged only once the re-measurement is complete
        assert gate.decide() == 0
        gate.observe(steady(4 * 3.0, 4))
    assert gate.decide() == 0
    gate.observe(steady(4 * 3.0, 4))
    assert not gate.plain_chosen
    assert gate.switches == 2


def test_hysteresis_keeps_the_current_side_on_a_near_draw():
    gate = PlainRunGate("auto", run_tokens=10)
    begin(gate, plain_ms_per_token=9.7)  # 3% cheaper: not enough to switch
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=10.0)
    assert not gate.plain_chosen
    assert gate.switches == 0


def test_run_tokens_must_be_positive():
    with pytest.raises(ValueError):
        PlainRunGate("auto", run_tokens=0)


def test_align_pieces_control_tokens_and_partial_tail():
    from proxy.engine.server_text import align_pieces

    assert align_pieces([b"Hel", b"lo"], "Hello") == [b"Hel", b"lo"]
    # a control token in the middle and an EOG at the end render as nothing
    assert align_pieces([b"a", b"<|im_start|>", b"b", b"<|im_end|>"], "ab") == [
        b"a", b"", b"b", b"",
    ]  # fmt: skip
    # "é" split over two tokens, complete
    assert align_pieces([b"x", b"\xc3", b"\xa9"], "xé") == [b"x", b"\xc3", b"\xa9"]
    # the run ends inside a character: the server's text ends in U+FFFD
    assert align_pieces([b"x", b"\xe1\xba"], "x\ufffd") == [b"x", b"\xe1\xba"]
    # a token whose piece is the replacement character itself
    assert align_pieces([b"\xef\xbf\xbd", b"y"], "\ufffdy") == [b"\xef\xbf\xbd", b"y"]


def test_align_pieces_with_invalid_bytes_inside_the_text():
    from proxy.engine.server_text import align_pieces

    # a lone partial character followed by ASCII: the server writes U+FFFD in the middle
    pieces = [b" ", b"\xe1\xba", b"_over", b"lap", b"<|im_end|>"]
    assert align_pieces(pieces, " \ufffd_overlap") == [b" ", b"\xe1\xba", b"_over", b"lap", b""]


def test_re_measurements_that_confirm_plain_runs_come_less_and_less_often():
    from proxy.policies.plain_runs import PROBE_SPEC_AFTER_MAX

    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    gaps = []
    for _ in range(7):
        runs = 0
        while gate.decide() == 16:
            gate.observe(plain_run(160.0, 16))
            runs += 1
        gaps.append(runs * 16)
        for _ in range(PROBE_SPEC_ROUNDS):  # the re-measurement: still dearer
            gate.observe(steady(3 * 20.0, 3))
            if gate._spec_probe_left:
                assert gate.decide() == 0
        assert gate.plain_chosen
    assert gaps[0] >= PROBE_SPEC_AFTER - 16
    for shorter, longer in itertools.pairwise(gaps):
        assert longer >= min(2 * shorter, PROBE_SPEC_AFTER_MAX) - 16
    assert max(gaps) <= PROBE_SPEC_AFTER_MAX


def test_a_dear_re_measurement_waits_until_its_cost_is_a_small_share():
    """A catch-up round of 1.5 s (6 slots prefilling 4k tokens each) is paid back by
    plain time: the next re-measurement waits until it is PROBE_BUDGET of it."""
    from proxy.policies.plain_runs import PROBE_BUDGET, PROBE_SPEC_AFTER_CAP

    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=10.0)  # plain: 10 ms a token
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    while gate.decide() == 16:
        gate.observe(plain_run(160.0, 16))
    gate.observe(catch_up(1500.0, 2))  # the slots catch up on the runs' tokens
    for _ in range(PROBE_SPEC_ROUNDS):
        gate.observe(steady(40.0, 2))  # 20 ms a token: plain runs stay
    assert gate.plain_chosen
    lost = (1500.0 - 2 * 10.0) + PROBE_SPEC_ROUNDS * (40.0 - 2 * 10.0)
    runs = 0
    while gate.decide() == 16:
        gate.observe(plain_run(160.0, 16))
        runs += 1
    assert runs * 16 >= lost / (PROBE_BUDGET * 10.0) - 16
    assert gate.snapshot()["probe_spec_after"] <= PROBE_SPEC_AFTER_CAP
    # a catch-up outside a re-measurement (speculation chosen) costs nothing extra
    quiet = PlainRunGate("auto")
    quiet.observe(catch_up(5000.0, 1))
    assert quiet._probe_loss_ms == 0.0


def test_each_switch_is_logged_once_with_both_rates(caplog):
    gate = PlainRunGate("auto", run_tokens=16)
    with caplog.at_level(logging.INFO, logger="proxy.policies.plain_runs"):
        begin(gate, plain_ms_per_token=7.0)
        speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=31.0)
        for _ in range(5):  # staying on plain runs says nothing more
            gate.decide()
            gate.observe(plain_run(16 * 7.0, 16))
        while gate.decide() == 16:
            gate.observe(plain_run(16 * 7.0, 16))
        for _ in range(PROBE_SPEC_ROUNDS):  # speculation became cheaper: switch back
            gate.decide()
            gate.observe(steady(4 * 2.0, 4))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "greedy requests: speculating 31.0 ms/token vs plain 7.0 ms/token: plain runs",
        "greedy requests: speculating 2.0 ms/token vs plain 7.0 ms/token: speculating again",
    ]


def test_timings_count_the_tokens_plain_runs_wrote():
    from proxy.engine import GenerationResult, RoundRecord

    rounds = [
        RoundRecord(3, 3, 4, draft_ms=1.0, verify_ms=20.0, overhead_ms=1.0),
        RoundRecord(0, 0, 16, draft_ms=0.0, verify_ms=100.0, overhead_ms=1.0, plain_run=True),
        RoundRecord(2, 0, 1, draft_ms=1.0, verify_ms=20.0, overhead_ms=1.0),
    ]
    result = GenerationResult(
        tokens=list(range(21)), content=b"", stop_type="limit", stopping_word="",
        truncated=False, has_new_line=False, n_prompt=5, n_prompt_cached=0, rounds=rounds,
        prompt_ms=10.0, predicted_ms=100.0,
    )  # fmt: skip
    timings = result.timings()
    assert timings["plain_run_n"] == 16 and timings["predicted_n"] == 21
    assert timings["draft_n"] == 5
    rounds.pop(1)
    assert "plain_run_n" not in result.timings()  # absent, like draft_n, when none


def test_speculation_bound_follows_the_drafter_speed():
    from proxy.policies.plain_runs import speculation_bound_ms

    # a free drafter: k + 1 tokens for one plain step at best
    assert speculation_bound_ms(10.0, 0.0, k_max=4) == pytest.approx(10.0 / 5)
    # a drafter slower than the server: never below half its own time per token
    assert speculation_bound_ms(9.3, 22.0) == pytest.approx(11.0)
    # one as fast as the server: k = 1, a plain step for two tokens
    assert speculation_bound_ms(10.0, 10.0) == pytest.approx(5.0)


def test_a_drafter_too_slow_to_win_is_ruled_out_without_a_round():
    """0.6B on a CPU at 22 ms a token against a 9.3 ms plain step: the first plain run,
    with the drafter timed beside it, settles it: plain runs for good (no speculative
    round, no slot copies)."""
    gate = PlainRunGate("auto", run_tokens=16)
    assert gate.decide() == 16
    gate.observe(plain_run(16 * 9.3, 16))
    gate.observe_drafter(22.0)  # reported after the run: it rules speculation out at once
    assert gate.hopeless() and gate.plain_chosen
    assert gate.decide() == 16
    for _ in range(100):
        if gate.decide() == 0:  # a re-measurement: its first round re-times the drafter
            gate.observe(catch_up(0.0, 0, drafter_ms=22.0))  # (its catch-up time aside)
            assert gate.decide() == 16  # ... and ends there
        gate.observe(plain_run(16 * 9.3, 16))
    assert gate.plain_chosen and gate.switches == 1


def test_a_fast_drafter_is_still_measured_by_its_rounds():
    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=9.3, drafter_ms=2.5)  # plain measured first ...
    assert not gate.hopeless() and not gate.plain_chosen
    # ... but the choice waits for MIN_SPEC_ROUNDS rounds of speculation
    for _ in range(MIN_SPEC_ROUNDS - 1):
        assert gate.decide() == 0
        gate.observe(steady(3 * 12.0, 3))  # dearer than plain, yet not judged yet
        assert not gate.plain_chosen
    assert gate.decide() == 0
    gate.observe(steady(3 * 12.0, 3))
    assert gate.plain_chosen


def test_requests_pass_through_while_plain_is_chosen_with_re_measuring_ones_between():
    from proxy.policies.plain_runs import PASS_REQUESTS, PASS_REQUESTS_MAX

    gate = PlainRunGate("auto", run_tokens=16)
    assert not gate.pass_through()  # nothing measured: the engine measures
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    assert gate.plain_chosen
    served = [i for i in range(400) if not gate.pass_through()]
    gaps = [b - a - 1 for a, b in itertools.pairwise(served)]
    assert served[0] == PASS_REQUESTS
    assert gaps[0] == 2 * PASS_REQUESTS and max(gaps) == PASS_REQUESTS_MAX
    assert not PlainRunGate("off").pass_through()


def test_plain_runs_beside_the_drafters_background_work_are_no_plain_speed():
    """On the H200's host a CPU drafter taking in a 4k context made plain runs beside it
    15 times slower; measured as the plain speed, that let losing speculation look
    close. Such runs decode on, but the gate waits for a run with the drafter idle."""
    gate = PlainRunGate("auto")
    n = gate.run_tokens
    for _ in range(3):  # the drafter still takes in the context
        assert gate.measuring_first() and gate.decide() == n
        busy = replace(plain_run(n * 150.0, n), drafter_busy=True)  # records are frozen
        gate.observe(busy)
    gate.observe_drafter(12.0)  # its speed arrives: not enough to rule it out at 150 ms
    assert gate.measuring_first() and gate.decide() == n  # still no plain speed
    gate.observe(plain_run(n * 10.0, n))
    assert not gate.measuring_first()
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=60.0)
    assert gate.prefers_plain()  # against the true plain speed, at once


@pytest.mark.parametrize("exploring", [True, False])
def test_rounds_sent_to_measure_a_length_are_no_speculation_speed(exploring):
    """The draft-length policy's first sweep sends costly lengths on purpose (on Strix
    Halo's 32B a k = 2 round can cost 3.4 steps); judged by them, the gate chose plain
    runs after six rounds although speculation at the chosen length wins."""
    gate = PlainRunGate("auto")
    begin(gate, 90.0)
    for _ in range(MIN_SPEC_ROUNDS):  # the sweep: 160 ms a token, far worse than plain
        assert gate.decide() == 0
        gate.observe(steady(320.0, 2), exploring=exploring)
    assert gate.plain_chosen is not exploring
    if exploring:
        speculate(gate, MIN_SPEC_ROUNDS, 60.0, tokens=2)  # the chosen length: 60 ms a token
        assert not gate.plain_chosen
        assert gate.snapshot()["spec_ms_per_token"] == pytest.approx(60.0)


def test_one_draft_rounds_by_chance_do_not_switch_to_plain_runs():
    """At one draft a round each round commits 1 or 2 tokens, so a rate pooled over a
    few rounds swings by chance. On the Strix Halo 14B file (emulated) a 400-token
    warm-up that speculated at ~35 ms a token met an 8-round window at 46.3 and chose
    plain runs (42.2). Rounds of 61.5 ms committing 1 + Bernoulli(0.73) tokens (35.5 ms
    a token) never lose to a 42.2 ms plain step, however long they run."""
    draws = random.Random(3)
    gate = PlainRunGate()
    gate.observe(plain_run(16 * 42.2, 16))
    gate.observe_drafter(11.0)
    for _ in range(400):
        gate.observe(steady(61.5, 1 + (draws.random() < 0.73), drafter_ms=11.0))
        assert not gate.plain_chosen, gate.snapshot()


def test_a_cold_requests_slot_fill_is_charged_to_speculation_over_a_requests_length():
    """H200, 512, 14B f16: steady rounds within 3% of plain runs, and each cold request's
    slot copies ~210 ms. Over 128-token requests that is 1.6 ms a token more: plain runs
    win once a request's length is known. Over long answers the fill is spread thin,
    and speculation, within the hysteresis of plain runs, is kept."""

    def serve(gate: PlainRunGate, n_tokens: int, fill_ms: float) -> None:
        first = replace(steady(30.0, 1), first=True, overhead_ms=fill_ms)
        gate.observe(first)
        gate.observe(replace(catch_up(30.0, 3), overhead_ms=2.0))
        speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=9.5)
        gate.observe_request(n_tokens)

    short = PlainRunGate("auto", run_tokens=16)
    begin(short, plain_ms_per_token=9.6)
    serve(short, 128, fill_ms=210.0)
    assert short.cold_ms == pytest.approx(212.0)
    assert short.plain_chosen  # 9.5 + 212 / 128 against 9.6

    long = PlainRunGate("auto", run_tokens=16)
    begin(long, plain_ms_per_token=9.6)
    serve(long, 4096, fill_ms=210.0)
    assert not long.plain_chosen  # 9.5 + 212 / 4096: within the hysteresis

    no_fill = PlainRunGate("auto", run_tokens=16)
    begin(no_fill, plain_ms_per_token=9.6)
    serve(no_fill, 128, fill_ms=0.0)
    assert not no_fill.plain_chosen


def test_a_catch_up_round_that_prefilled_what_no_copy_was_made_for_counts_as_cold_cost():
    """A later request whose slots lag by more than a copy is worth (`copy_pays`)
    prefills what they lack inside its catch-up round: 150 ms for 3 tokens where steady
    rounds take 9.5 ms a token. The 121.5 ms beyond a steady round are its cold cost, as
    a copy's time in the proxy's overhead would have been."""
    gate = PlainRunGate("auto", run_tokens=16)
    begin(gate, plain_ms_per_token=9.6)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=9.5)
    gate.observe(replace(steady(30.0, 1), first=True, overhead_ms=5.0))
    gate.observe(replace(catch_up(150.0, 3), overhead_ms=2.0))
    speculate(gate, 1, ms_per_token=9.5)
    assert gate.cold_ms == pytest.approx(5.0 + 150.0 - 3 * 9.5)


class FixedModel:
    """A cost model whose speedup is `factor` at any acceptance (the drafter-length
    policy's role): the rounds measured acceptance 0.5."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.baselines: list[float] = []

    def acceptance_rate(self) -> float:
        return 0.5

    def speedup_at(self, a: float, baseline: float) -> float:
        self.baselines.append(baseline)
        return self.factor


def shadow_gate(speedup_of_a: float | None, draft: tuple[int, bool] | None) -> PlainRunGate:
    """A gate that chose plain runs (speculation 20 ms a token, plain 10), whose shadow
    checks each see `draft` (accepted, rejected; None: no draft is done in time) and
    whose cost model scales speculation by `speedup_of_a` at any acceptance (None: no
    model)."""
    from proxy.policies.plain_runs import SHADOW_RUNS

    model = FixedModel(speedup_of_a) if speedup_of_a else None
    gate = PlainRunGate("auto", run_tokens=16, model=model)
    gate._test_shadow = draft  # type: ignore[attr-defined]
    begin(gate, plain_ms_per_token=10.0)
    speculate(gate, MIN_SPEC_ROUNDS, ms_per_token=20.0)
    assert gate.plain_chosen and SHADOW_RUNS * 16 < PROBE_SPEC_AFTER
    return gate


def run_to_due(gate: PlainRunGate, every: int = 1) -> int:
    """Plain runs until `decide` starts a re-measurement (0) or a re-measurement was
    skipped; every `every`-th shadowed run's draft is judged, as the gate was told (a
    drafter slower than the runs drafts beside every other one). Returns the runs
    shadowed."""
    shadowed = 0
    skipped = gate.shadow_skipped
    while gate.decide() == gate.run_tokens:
        if gate.shadow_skipped > skipped:
            return shadowed
        if gate.wants_shadow():
            shadowed += 1
            draft = gate._test_shadow  # type: ignore[attr-defined]
            if draft is not None and shadowed % every == 0:
                gate.observe_shadow(*draft, gate.shadow_window)
        gate.observe(plain_run(gate.run_tokens * 10.0, gate.run_tokens))
    return shadowed


def test_drafts_beside_plain_runs_that_predict_a_loss_skip_the_re_measurement():
    """Each draft beside the last runs before a due re-measurement has 1 token accepted,
    then a rejection (acceptance 0.5): speculation, 20 ms a token when measured, would
    be no faster now (factor 1): the re-measurement is skipped, with its copies, and the
    wait doubles."""
    from proxy.policies.plain_runs import SHADOW_RUNS

    gate = shadow_gate(1.0, (1, True))
    assert not gate.wants_shadow()  # not before the last SHADOW_RUNS runs
    assert run_to_due(gate) == SHADOW_RUNS
    assert gate.shadow_skipped == 1 and gate.shadow_acceptance == pytest.approx(0.5)
    assert gate.plain_chosen and gate._spec_probe_left == 0
    assert gate.snapshot()["probe_spec_after"] == 2 * PROBE_SPEC_AFTER


def test_drafts_beside_plain_runs_that_predict_a_win_re_measure_speculation():
    """Same, but the cost model says speculation is 2.5x faster at what the drafts beside
    the runs accepted (20 / 2.5 = 8 ms a token against plain's 10): real rounds
    re-measure it."""
    gate = shadow_gate(2.5, (3, False))
    run_to_due(gate)
    assert gate.shadow_skipped == 0 and gate.shadow_acceptance == pytest.approx(1.0)
    assert gate._spec_probe_left == PROBE_SPEC_ROUNDS


@pytest.mark.parametrize(
    ("speedup", "draft"),
    [(None, (1, True)), (1.0, None)],
    ids=["no-cost-model", "no-draft-checked"],
)
def test_without_a_judgeable_shadow_check_speculation_is_re_measured(speedup, draft):
    from proxy.policies.plain_runs import SHADOW_RUNS

    gate = shadow_gate(speedup, draft)
    shadowed = run_to_due(gate)
    assert gate.shadow_skipped == 0
    assert gate._spec_probe_left == PROBE_SPEC_ROUNDS
    # no model: no checks, nothing to wait for; a model but no draft judged: the checks
    # get SHADOW_RUNS more runs once, then the re-measurement is made
    assert shadowed == (0 if speedup is None else 2 * SHADOW_RUNS)


def test_too_few_drafts_by_the_due_point_get_more_runs_once():
    """A drafter slower than the runs drafts beside every other one: SHADOW_RUNS / 2
    drafts by the due point are too few to judge by, so the checks go on for
    SHADOW_RUNS more runs, and then they decide (here: skip, acceptance 0.5)."""
    from proxy.policies.plain_runs import SHADOW_MIN_DRAFTS, SHADOW_RUNS

    assert SHADOW_RUNS // 2 < SHADOW_MIN_DRAFTS <= SHADOW_RUNS
    gate = shadow_gate(1.0, (1, True))
    assert run_to_due(gate, every=2) == 2 * SHADOW_RUNS
    assert gate.shadow_skipped == 1 and gate._spec_probe_left == 0
    assert gate.snapshot()["probe_spec_after"] == 2 * PROBE_SPEC_AFTER
    assert run_to_due(gate) == SHADOW_RUNS  # the next window is not put off


def test_every_few_skipped_re_measurements_one_is_made_anyway():
    """A shorter context or a less busy server changes speculation's rate where the
    drafts' acceptance does not: after SHADOW_SKIPS_MAX skips in a row, real rounds."""
    from proxy.policies.plain_runs import SHADOW_SKIPS_MAX

    gate = shadow_gate(1.0, (1, True))
    for skipped in range(1, SHADOW_SKIPS_MAX + 1):
        run_to_due(gate)
        assert gate.shadow_skipped == skipped and gate._spec_probe_left == 0
    run_to_due(gate)
    assert gate.shadow_skipped == SHADOW_SKIPS_MAX
    assert gate._spec_probe_left == PROBE_SPEC_ROUNDS


def test_drafts_judged_after_their_re_measurement_was_decided_are_dropped():
    """A draft still running when the due re-measurement is decided is judged later:
    it belongs to no later window, and the cost model hears the acceptance the rounds
    measured when the speculation rate was measured."""
    gate = shadow_gate(1.0, (1, True))
    stale = gate.shadow_window
    run_to_due(gate)
    assert gate.shadow_skipped == 1 and gate.shadow_window == stale + 1
    assert gate.model.baselines == [0.5]  # type: ignore[union-attr]
    for _ in range(20):
        gate.observe_shadow(3, False, stale)  # late, all accepted: would have counted
    assert gate._shadow_drafts == 0 and gate._shadow_accepted == 0
