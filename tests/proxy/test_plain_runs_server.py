"""Plain runs (proxy.plain_runs) against real servers: lossless, and chosen when
speculation costs more per token than letting llama-server decode alone."""

from __future__ import annotations

import pytest

from proxy.engine import Generation, GenerationParams, PieceCache
from proxy.plain_runs import PlainRunGate
from proxy.upstream import UpstreamClient
from tests.proxy.conftest import run_proxy
from tests.proxy.helpers import assert_greedy_equal, post_json, tokenize

pytestmark = [pytest.mark.server, pytest.mark.slow]


class AlwaysRun(PlainRunGate):
    """Every round after the first is a plain run of `run_tokens`."""

    def choose(self) -> int:
        return self.run_tokens


async def test_plain_runs_are_the_servers_own_greedy_tokens(
    spec_server, reference_drafter, http, ref_server
):
    prompt = await tokenize(http, ref_server, "def fibonacci(n):\n    ")
    n_predict = 23  # not a multiple of the run length: the last run is cut to fit
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(spec_server) as upstream:
        props = await upstream.props()
        generation = Generation(
            upstream,
            prompt,
            GenerationParams(n_predict=n_predict, k=3),
            n_ctx=props["default_generation_settings"]["n_ctx"],
            drafter=reference_drafter(),
            pieces=PieceCache(upstream),
            check_decodes=True,
            plain_runs=AlwaysRun("auto", run_tokens=5),
        )
        tokens = [event.token async for event in generation.run()]
    result = generation.result
    assert result is not None
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    assert len(tokens) == n_predict
    first, runs = result.rounds[0], result.rounds[1:]
    assert not first.plain_run and first.n_drafted == 3
    assert runs and all(r.plain_run and r.n_drafted == 0 for r in runs)
    assert [r.n_committed for r in runs] == [5] * (len(runs) - 1) + [runs[-1].n_committed]
    assert sum(r.n_committed for r in result.rounds) == n_predict
    # the server's own loop: one decode per token, the context suffix in the first
    assert [r.decodes for r in runs] == [r.n_committed for r in runs]


async def test_gate_picks_plain_runs_when_drafts_are_never_accepted(
    spec_server, drafter_for, http, ref_server
):
    body = {"prompt": "Once upon a time", "n_predict": 96, "temperature": 0,
            "return_tokens": True}  # fmt: skip
    expected = await post_json(http, ref_server + "/completion", body)
    prompt = await tokenize(http, ref_server, body["prompt"])
    # An unrelated draft commits one token per verify round, which costs more than
    # one plain step: the gate must switch and stay switched.
    async with run_proxy(spec_server, drafter_for("reference:unrelated"), 4) as proxy:
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        gate = proxy.state.plain_run_gate.snapshot()
        assert proxy.state.metrics.plain_runs > 0
        assert gate["plain_chosen"], gate
        assert gate["plain_ms_per_token"] < gate["spec_ms_per_token"], gate
        metrics = await (await proxy.session.get(proxy.url + "/metrics")).text()
        assert "npu_spec_plain_runs_chosen 1" in metrics
    async with run_proxy(
        spec_server, drafter_for("reference:unrelated"), 4, plain_runs="off"
    ) as proxy:
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        assert proxy.state.metrics.plain_runs == 0
        assert proxy.state.metrics.rounds >= 90  # ~one token per round
