"""Plain runs (proxy.policies.plain_runs) against real servers: lossless, and chosen when
speculation costs more per token than letting llama-server decode alone."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from proxy.engine import EngineSettings, GenerationParams, RoundRecord, SlotReplicator
from proxy.engine.rounds import ROUND_LOG
from proxy.policies import PlainRunGate
from proxy.policies.plain_runs import MIN_SPEC_ROUNDS, PASS_REQUESTS, SHADOW_RUNS
from proxy.server.upstream import UpstreamClient
from tests.proxy.conftest import run_proxy
from tests.proxy.helpers import assert_greedy_equal, generate, post_json, tokenize, with_gate
from tests.support.scripts import load_script

pytestmark = [pytest.mark.server, pytest.mark.slow]


class AlwaysRun(PlainRunGate):
    """Every round after the first is a plain run of `run_tokens`."""

    def decide(self) -> int:
        return self.run_tokens


async def test_plain_runs_are_the_servers_own_greedy_tokens(
    spec_server, reference_drafter, http, ref_server, caplog
):
    prompt = await tokenize(http, ref_server, "def fibonacci(n):\n    ")
    n_predict = 23  # not a multiple of the run length: the last run is cut to fit
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(spec_server) as upstream:
        with caplog.at_level(logging.DEBUG, logger=ROUND_LOG):
            tokens, result = await generate(
                upstream, prompt, GenerationParams(n_predict=n_predict), reference_drafter(),
                settings=EngineSettings(k=3, check_decodes=True),
                policies=with_gate(EngineSettings(k=3), AlwaysRun("auto", run_tokens=5)),
            )  # fmt: skip
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    assert len(tokens) == n_predict
    first, runs = result.rounds[0], result.rounds[1:]
    # what served the response: all but the first round's token came from plain runs;
    # nothing measured yet, so the first round prefilled one slot and drafted nothing
    assert result.timings()["plain_run_n"] == n_predict - first.n_committed
    assert not first.plain_run and first.n_drafted == 0 and first.n_committed == 1
    assert runs and all(r.plain_run and r.n_drafted == 0 for r in runs)
    assert [r.n_committed for r in runs] == [5] * (len(runs) - 1) + [runs[-1].n_committed]
    assert sum(r.n_committed for r in result.rounds) == n_predict
    # the server's own loop: one decode per token, the context suffix in the first
    assert [r.decodes for r in runs] == [r.n_committed for r in runs]
    # `--log-rounds`: a line per run, its server time inside its wall time; the drafter
    # timed itself beside the first (the gate had no drafter speed yet)
    lines = [f"x {r.getMessage()}" for r in caplog.records if r.name == ROUND_LOG]
    logged = load_script("round_log_summary").runs_of(lines)
    assert [line["n_run_tokens"] for line in logged] == [r.n_committed for r in runs]
    assert all(0 < line["server_ms"] <= line["run_ms"] for line in logged)
    assert logged[0]["beside"] == "timing" and logged[0]["n_context"] == len(prompt) + 1


async def test_gate_picks_plain_runs_when_drafts_are_never_accepted(
    spec_server, drafter_for, http, ref_server, caplog
):
    body = {"prompt": "Once upon a time", "n_predict": 96, "temperature": 0,
            "return_tokens": True}  # fmt: skip
    expected = await post_json(http, ref_server + "/completion", body)
    prompt = await tokenize(http, ref_server, body["prompt"])
    # An unrelated draft commits one token per verify round, which costs more than
    # one plain step: the gate must switch and stay switched.
    async with run_proxy(
        spec_server, drafter_for("reference:unrelated"), 4, plain_runs="auto"
    ) as proxy:
        with caplog.at_level(logging.INFO, logger="proxy.policies.plain_runs"):
            status, got, headers = await proxy.post("/completion", body)
        assert status == 200, got
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        # the response says how much of it plain runs wrote, the log says why once
        assert headers["X-Npu-Spec"] == "speculative"
        plain_n = got["timings"]["plain_run_n"]
        assert plain_n == proxy.state.metrics.plain_run_tokens > len(got["tokens"]) // 2
        switches = [r.getMessage() for r in caplog.records if "ms/token" in r.getMessage()]
        assert len(switches) == 1 and switches[0].endswith("plain runs"), switches
        gate = proxy.state.policies.plain_runs.snapshot()
        assert proxy.state.metrics.plain_runs > 0
        assert gate["plain_chosen"], gate
        # either the drafter, timed beside the first plain run, was too slow to win
        # at all (the reason the log gives; its speed measured later may differ), or
        # its rounds (one token each) measured dearer than plain runs
        if "allows speculating no faster than" not in switches[0]:
            assert gate["spec_ms_per_token"] is not None, (switches, gate)
            assert gate["plain_ms_per_token"] < gate["spec_ms_per_token"], (switches, gate)
        metrics = await (await proxy.session.get(proxy.url + "/metrics")).text()
        assert "npu_spec_plain_runs_chosen 1" in metrics
        # the next requests go to llama-server whole, the same text, until one re-measures
        rounds = proxy.state.metrics.rounds
        for _ in range(PASS_REQUESTS):
            status, again, headers = await proxy.post("/completion", body)
            assert status == 200 and headers["X-Npu-Spec"] == "passthrough", again
            assert again["tokens"] == got["tokens"]
        assert proxy.state.metrics.rounds == rounds
        status, again, headers = await proxy.post("/completion", body)
        assert headers["X-Npu-Spec"] == "speculative" and again["tokens"] == got["tokens"]
        assert proxy.state.metrics.rounds > rounds
    async with run_proxy(
        spec_server, drafter_for("reference:unrelated"), 4, plain_runs="off"
    ) as proxy:
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        assert proxy.state.metrics.plain_runs == 0
        assert proxy.state.metrics.rounds >= 90  # ~one token per round


class CountingReplicator(SlotReplicator):
    def __init__(self, upstream: UpstreamClient) -> None:
        super().__init__(upstream)
        self.calls = 0

    async def replicate(self, *args: Any, **kwargs: Any) -> list[int]:
        self.calls += 1
        return await super().replicate(*args, **kwargs)


@pytest.mark.parametrize("plain_preferred", [True, False])
async def test_no_slot_copies_for_a_request_that_starts_in_plain_runs(
    spec_server, reference_drafter, http, ref_server, plain_preferred
):
    # long enough for the first round to copy its slot, and new to the server's slots
    text = ("The lighthouse keeper wrote " if plain_preferred else "A quiet river runs ") * 24
    prompt = await tokenize(http, ref_server, text)
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": 20, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(spec_server) as upstream:
        replicator = CountingReplicator(upstream)
        assert len(prompt) >= replicator.min_prompt
        gate = AlwaysRun("auto", run_tokens=8)
        # as if earlier requests had measured plain runs (10 ms a token) and the drafter
        # (1 ms a token: speculation may win), and chosen
        gate.observe(RoundRecord(0, 0, 8, 0.0, 80.0, 0.0, plain_run=True, n_run_tokens=8))
        gate.observe_drafter(1.0)
        gate.plain_chosen = plain_preferred
        tokens, result = await generate(
            upstream, prompt, GenerationParams(n_predict=20), reference_drafter(),
            settings=EngineSettings(k=3), replicator=replicator,
            policies=with_gate(EngineSettings(k=3), gate),
        )  # fmt: skip
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    first = result.rounds[0]
    assert first.n_drafted == 0 and first.n_committed == 1  # one slot prefilled
    assert all(r.plain_run for r in result.rounds[1:])
    assert replicator.calls == (0 if plain_preferred else 1)


async def test_sampling_plain_run_is_the_servers_own_draw_with_the_request_chain(spec_server, http):
    from npu_draft.protocol import SamplingParams
    from proxy.data.sampling import SamplingSpec
    from proxy.server.upstream import SAMPLING_CHAIN

    chain = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02)
    spec = SamplingSpec(chain=chain, min_keep=0, seed=None)
    prompt = await tokenize(http, spec_server, "Once upon a time")
    async with UpstreamClient(spec_server) as upstream:
        run = await upstream.plain_run(prompt, 12, spec, seed=1234)
    # llama-server alone, asked directly with the same chain and seed
    direct = await post_json(
        http,
        spec_server + "/completion",
        {"prompt": prompt, "n_predict": 12, "return_tokens": True, "seed": 1234,
         "temperature": 0.9, "top_k": 20, "top_p": 0.95, "min_p": 0.02,
         "samplers": SAMPLING_CHAIN},
    )  # fmt: skip
    assert run.tokens == direct["tokens"] and len(run.tokens) == 12


async def test_unseeded_sampling_switches_to_plain_runs_seeded_never_does(spec_server, drafter_for):
    body = {"prompt": "Once upon a time", "n_predict": 80, "temperature": 0.8, "top_k": 10,
            "top_p": 1.0, "min_p": 0.0, "return_tokens": True}  # fmt: skip
    async with run_proxy(
        spec_server, drafter_for("reference:unrelated"), 3, plain_runs="auto"
    ) as proxy:
        status, got, _ = await proxy.post("/completion", {**body, "seed": 5})
        assert status == 200, got
        assert proxy.state.metrics.plain_runs == 0  # seeded: reproducible, always speculates
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        assert len(got["tokens"]) == 80
        assert proxy.state.metrics.plain_runs > 0
        assert proxy.state.policies.sampled_plain_runs.prefers_plain()
        assert not proxy.state.policies.plain_runs.prefers_plain()  # greedy measured apart


class RunsThenSpeculate(PlainRunGate):
    """Plain runs for the first `runs` choices, speculation after them."""

    def __init__(self, runs: int, run_tokens: int) -> None:
        super().__init__("auto", run_tokens=run_tokens)
        self.runs_left = runs
        self.plain_chosen = True  # as if earlier requests had measured it

    def decide(self) -> int:
        if self.runs_left > 0:
            self.runs_left -= 1
            return self.run_tokens
        return 0


async def test_speculating_after_plain_runs_copies_the_slot_that_holds_the_context(
    spec_server, reference_drafter, http, ref_server
):
    """A request starts in plain runs (one slot), then speculates: the slot that holds
    the context is copied first, so the round does not prefill the prompt in k slots."""
    text = "The cartographer measured the coastline twice " * 20
    prompt = await tokenize(http, ref_server, text)
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": 40, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(spec_server) as upstream:
        replicator = CountingReplicator(upstream)
        tokens, result = await generate(
            upstream, prompt, GenerationParams(n_predict=40), reference_drafter(),
            settings=EngineSettings(k=3, check_decodes=True), replicator=replicator,
            policies=with_gate(EngineSettings(k=3), RunsThenSpeculate(2, 8)),
        )  # fmt: skip
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    first, runs, after = result.rounds[0], result.rounds[1:3], result.rounds[3]
    assert first.n_drafted == 0 and all(r.plain_run for r in runs)
    assert not after.plain_run and after.n_drafted > 0
    assert replicator.calls == 1  # before the first speculative round, not at the start
    assert after.decodes == 1
    assert after.prompt_tokens < len(prompt) // 2, after  # the copies hold the context


class SpeculateThenChoosePlain(PlainRunGate):
    """Speculates every round; by the generation's end plain decoding is chosen (as a
    gate that measured speculation losing would have)."""

    def decide(self) -> int:
        return 0

    def measuring_first(self) -> bool:
        return False

    def prefers_plain(self) -> bool:
        return self.plain_chosen


async def test_every_slot_is_emptied_once_plain_decoding_is_chosen(
    spec_server, reference_drafter, http, ref_server
):
    """Passed-through requests then decode with unified KV over the pool up to its
    highest cell in use, and a speculative generation's context lies spread over it:
    the generation that chose plain decoding empties every slot it filled, the one that
    holds its context too (a next turn prefills it once, into one slot's cells)."""
    text = "The lighthouse keeper counted the ships " * 16  # long enough to copy
    prompt = await tokenize(http, ref_server, text)
    async with UpstreamClient(spec_server) as upstream:
        for slot in await upstream.slots():  # a clean start: other tests' leftovers
            await upstream.slot_action(slot["id"], "erase", "")
        gate = SpeculateThenChoosePlain("auto")
        policies = with_gate(EngineSettings(k=3), gate)
        replicator = CountingReplicator(upstream)
        generation = generate(
            upstream, prompt, GenerationParams(n_predict=24), reference_drafter(),
            settings=EngineSettings(k=3), replicator=replicator, policies=policies,
        )  # fmt: skip
        gate.plain_chosen = True  # chosen while the generation runs
        _, result = await generation
        assert replicator.calls == 1 and any(r.n_drafted for r in result.rounds)
        held = [
            (await upstream.slot_action(slot["id"], "erase", ""))["n_erased"]
            for slot in await upstream.slots()
        ]
    assert result.rounds and sum(n > 0 for n in held) == 0, held


async def test_a_pass_through_alone_leaves_only_its_own_context_in_the_slots(spec_server, http):
    """llama-server gives a prompt no slot holds the least recently used slot, so each
    new conversation passed through would leave the last one's context in place, and
    with unified KV every decode attends over all of them. Alone, the proxy keeps the
    context the server used last and empties the rest."""
    async with UpstreamClient(spec_server) as upstream:
        for slot in await upstream.slots():  # a clean start: other tests' leftovers
            await upstream.slot_action(slot["id"], "erase", "")
        async with run_proxy(spec_server, None, 2) as proxy:
            for topic in ("lighthouses", "glaciers", "violins"):
                body = {"prompt": f"Tell me about {topic}. " * 6, "n_predict": 8,
                        "temperature": 0}  # fmt: skip
                status, _, headers = await proxy.post("/completion", body)
                assert status == 200 and headers["X-Npu-Spec"] == "passthrough"
                await proxy.state.background.wait()
                held = [s for s in await upstream.slots() if s.get("n_prompt_tokens", 0) > 0]
                assert len(held) == 1, held
            last = held[0]
            status, _, _ = await proxy.post("/completion", body)  # the same prompt again
            await proxy.state.background.wait()
            again = [s for s in await upstream.slots() if s.get("n_prompt_tokens", 0) > 0]
    assert [s["id"] for s in again] == [last["id"]]  # kept, and found by the server


@pytest.mark.parametrize(("draft", "re_measured"), [("same", True), ("unrelated", False)])
async def test_drafts_beside_plain_runs_decide_whether_speculation_is_re_measured(
    spec_server, drafter_for, http, ref_server, draft, re_measured
):
    """Plain runs were chosen (speculation measured at 60 ms a token, one of each
    round's three drafts accepted, against plain's 40: slow enough that the real
    server's runs, measured once no draft runs beside them, keep plain runs chosen even
    on a loaded machine). In the runs before the next
    re-measurement is due the drafter drafts beside each run and its draft is checked
    against the run's tokens: a draft that writes what the target writes predicts
    speculation winning, and real rounds re-measure it; an unrelated one predicts a
    loss, and the re-measurement (its slot copies, its rounds) is skipped. The output
    is the server's either way."""
    prompt = await tokenize(http, ref_server, "The history of the printing press")
    # room for the checks to be put off once (a drafter slower than the runs on a busy
    # machine judges fewer than SHADOW_MIN_DRAFTS drafts by the due point)
    n_predict = 1 + (2 * SHADOW_RUNS + 2) * 16
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True},
    )
    settings = EngineSettings(k=3, plain_runs="auto")
    shared = settings.policies()
    gate = shared.plain_runs
    plain = RoundRecord(0, 0, 16, 0.0, 640.0, 0.0, plain_run=True, n_run_tokens=16)
    gate.observe(plain)
    gate.observe_drafter(1.0)
    for _ in range(MIN_SPEC_ROUNDS):  # k = 3, one accepted: 2 tokens in 120 ms
        spec = RoundRecord(3, 1, 2, 1.0, 118.0, 1.0, round_ms=120.0, draft_probs=[0.5] * 3)
        shared.draft_length.observe(spec)
        gate.observe(spec)
    assert gate.plain_chosen
    while not gate.wants_shadow():  # plain runs until the checks are due
        assert gate.decide() == 16
        gate.observe(plain)
    async with UpstreamClient(spec_server) as upstream:
        tokens, result = await generate(
            upstream, prompt, GenerationParams(n_predict=n_predict),
            drafter_for(f"reference:{draft}")(), settings=settings,
            policies=shared.for_request(None),
        )  # fmt: skip
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    rounds = [r for r in result.rounds[1:] if not r.plain_run]
    assert gate.shadow_acceptance is not None
    if re_measured:
        assert gate.shadow_acceptance > 0.9 and gate.shadow_skipped == 0
        assert rounds and rounds[0].n_drafted > 0  # real rounds after the runs
    else:
        assert gate.shadow_acceptance < 0.3 and gate.shadow_skipped == 1
        assert not rounds  # plain runs to the end
