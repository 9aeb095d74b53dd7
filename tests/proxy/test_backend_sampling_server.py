"""`--backend-sampling on` against real servers: greedy verify rounds and plain runs ask
llama-server to pick each token on its backend, and the output still equals llama-server
alone, which samples on the host."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.engine import EngineSettings, GenerationParams
from proxy.server.upstream import RawJson, UpstreamClient
from tests.proxy.conftest import run_proxy
from tests.proxy.helpers import (
    assert_greedy_equal,
    assert_rejections_are_near_ties,
    generate,
    post_json,
    record_rounds,
    recording,
    tokenize,
    with_gate,
)
from tests.proxy.test_plain_runs_server import AlwaysRun
from tests.support.scripts import load_script

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _sent_bodies(upstream: UpstreamClient) -> list[dict]:
    """Every /completion body the client sends from now on."""
    bodies: list[dict] = []
    request_json = upstream._request_json

    async def spy(method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        if path == "/completion":
            bodies.append(json.loads(body.text) if isinstance(body, RawJson) else body)
        return await request_json(method, path, body, **kwargs)

    upstream._request_json = spy  # type: ignore[method-assign]
    return bodies


@pytest.mark.parametrize(("prompt", "drafter"), [
    ("def fibonacci(n):\n    ", "reference:noisy:0.05"),
    ("Once upon a time", "reference"),
])  # fmt: skip
async def test_verify_rounds_with_backend_sampling_equal_the_server_alone(
    http, ref_server, spec_server, drafter_for, prompt, drafter
):
    body = {"prompt": prompt, "n_predict": 48, "temperature": 0, "return_tokens": True}
    expected = await post_json(http, ref_server + "/completion", body)
    tokens = await tokenize(http, ref_server, prompt)
    drafts: dict[int, list[int]] = {}
    opener = recording(drafter_for(drafter), drafts)
    async with run_proxy(spec_server, opener, 4, backend_sampling=True) as proxy:
        bodies = _sent_bodies(proxy.state.upstream)
        rounds = record_rounds(proxy.state.metrics)
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        await assert_greedy_equal(http, ref_server, tokens, expected["tokens"], got["tokens"])
        # every round asked for it, and rounds with drafts were verified
        assert bodies and all(b.get("backend_sampling") is True for b in bodies)
        metrics = proxy.state.metrics
        assert metrics.draft_tokens > 0 and metrics.drafter_failures == 0
        if drafter == "reference":  # the target's own weights: only near-ties are rejected
            await assert_rejections_are_near_ties(
                http, ref_server, tokens, got["tokens"], rounds, drafts
            )


async def test_plain_runs_with_backend_sampling_equal_the_server_alone(
    spec_server, reference_drafter, http, ref_server
):
    prompt = await tokenize(http, ref_server, "The capital of France is")
    expected = await post_json(
        http, ref_server + "/completion",
        {"prompt": prompt, "n_predict": 30, "temperature": 0, "return_tokens": True},
    )  # fmt: skip
    async with UpstreamClient(spec_server, backend_sampling=True) as upstream:
        bodies = _sent_bodies(upstream)
        tokens, result = await generate(
            upstream, prompt, GenerationParams(n_predict=30), reference_drafter(),
            policies=with_gate(EngineSettings(k=3), AlwaysRun("auto", run_tokens=8)),
        )  # fmt: skip
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    assert sum(r.plain_run for r in result.rounds) >= 3
    assert bodies and all(b.get("backend_sampling") is True for b in bodies)


async def test_the_server_takes_backend_sampling_only_when_asked(spec_server, http, ref_server):
    """Off: no field is sent, and the slots that served the requests sample on the host
    (the server's default); on: the field is sent and those slots took it."""
    prompt = await tokenize(http, ref_server, "Once upon a time")
    for on in (False, True):
        async with UpstreamClient(spec_server, backend_sampling=on) as upstream:
            bodies = _sent_bodies(upstream)
            results = await upstream.verify(prompt, prompt[:2])
            run = await upstream.plain_run(prompt, 2)
            used = {r.id_slot for r in results} | {run.id_slot}
            slots = {slot["id"]: slot for slot in await upstream.slots()}
        assert len(bodies) == 2
        if on:
            assert all(b["backend_sampling"] is True for b in bodies)
        else:
            assert not any("backend_sampling" in b for b in bodies)
        # /slots shows each slot's last task's parameters
        assert {slots[i]["params"]["backend_sampling"] for i in used} == {on}


def test_the_check_script_compares_both_ways_on_one_server(demo_models, tmp_path, capsys):
    """scripts/backend_sampling_check.py: both ways' medians, and their tokens agreed."""
    out = tmp_path / "backend-sampling.json"
    script = load_script("backend_sampling_check")
    model = demo_models / "target.gguf"
    assert script.main(["--model", str(model), "-k", "2", "--rounds", "2", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["equal"] == {"rounds": 2, "runs": 2}
    for row in result["ways"].values():
        assert row["wall"] >= row["server"] > 0 and row["run"] > 0 and row["spread"] >= 0
    table = capsys.readouterr().out
    assert "| host sampling |" in table and "| backend sampling |" in table
