"""Greedy output through the proxy equals llama-server alone, against real servers."""

from __future__ import annotations

import itertools

import pytest

from proxy.engine import EngineSettings, GenerationParams, SlotReplicator
from proxy.policies.padding import BLOCK_ROUNDS as PAD_BLOCK
from proxy.server.upstream import UpstreamClient
from tests.proxy.conftest import CTX, run_proxy
from tests.proxy.helpers import (
    RecordingDrafter,
    assert_greedy_equal,
    assert_rejections_are_near_ties,
    generate,
    implied_rounds,
    parse_sse,
    post_json,
    record_rounds,
    recording,
    shape,
    tokenize,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):\n    ",
    "The capital of France is",
]

# (prompt, new tokens, k, drafter, one-decode check, padded rounds): small enough for
# two CPU cores, wide enough to cover k = 1..8, lengths 1..512, full acceptance, partial
# acceptance and none. The check reads the server's decode counter after every round,
# which rules out sending the next round ahead (`--send-ahead`, the default): the rows
# without it run the default path. Padded rounds (`--pad-rounds on`, or `auto`'s blocks
# of padded rounds while it measures) add a prompt of their own to the batch, which
# must stay one decode and change nothing in the output.
GRID = [
    (0, 1, 1, "reference", True, "off"),
    (1, 17, 3, "reference", False, "off"),
    (2, 64, 8, "reference", True, "off"),
    (0, 512, 8, "reference", False, "auto"),
    (1, 40, 4, "ngram", True, "off"),
    (2, 48, 5, "reference:noisy:0.05", False, "on"),
    (0, 24, 2, "reference:unrelated", True, "off"),
    (1, 40, 4, "onnx", False, "off"),
    (2, 40, 6, "genai", True, "off"),
    (0, 64, 3, "reference:noisy:0.05", True, "on"),
]

# Fields whose values depend on time, cache state or slot choice, not on the output.
VOLATILE = {"timings", "id_slot", "tokens_cached"}


@pytest.mark.parametrize(("prompt_index", "n_predict", "k", "drafter", "checked", "padded"), GRID)
async def test_native_completion_matches_server(
    http, ref_server, spec_server, drafter_for, prompt_index, n_predict, k, drafter, checked,
    padded,
):  # fmt: skip
    body = {
        "prompt": PROMPTS[prompt_index],
        "n_predict": n_predict,
        "temperature": 0,
        "return_tokens": True,
    }
    expected = await post_json(http, ref_server + "/completion", body)
    prompt = await tokenize(http, ref_server, PROMPTS[prompt_index])
    drafts: dict[int, list[int]] = {}
    opener = recording(drafter_for(drafter), drafts)
    async with run_proxy(spec_server, opener, k, check_decodes=checked, pad_rounds=padded) as proxy:
        rounds = record_rounds(proxy.state.metrics)
        status, got, headers = await proxy.post("/completion", body)
        assert status == 200, got
        assert headers["X-Npu-Spec"] == "speculative"
        compared = await assert_greedy_equal(
            http, ref_server, prompt, expected["tokens"], got["tokens"]
        )
        if compared == len(expected["tokens"]):  # no near-tie: the whole answer is equal
            for key in set(expected) - VOLATILE:
                assert got[key] == expected[key], key
        assert shape(got) == shape(expected) or _shape_without_drafts(got) == shape(expected)
        metrics = proxy.state.metrics
        # One llama_decode per verify round, every round (the first included: its
        # k+1 prompts fit one batch).
        assert metrics.rounds > 0
        assert metrics.decode_check_failures == 0
        verify = [r for r in rounds if not getattr(r, "plain_run", False)]
        sent_ahead = [r.sent_ahead for r in verify]
        # unchecked, the default path: rounds went out before the last one was streamed
        if checked:
            assert not any(sent_ahead)
        elif len(verify) > 3:
            assert any(sent_ahead)
        # a round of as many drafts as the last was padded to one batch size, and only
        # then (the one-decode check above holds with the pad prompt in the batch)
        pads = [r.pad_tokens for r in verify]
        could = [r.padded for r in verify if r.padded is not None]
        if padded == "off":
            assert not any(pads) and not could
        elif padded == "on" and len(verify) > 6:
            assert any(pads) and all(could)
        elif padded == "auto" and len(could) > 2 * PAD_BLOCK:  # both sides measured
            assert True in could and False in could
        for last, record in itertools.pairwise(verify):
            assert not record.pad_tokens or record.n_drafted == last.n_drafted
        # the drafter served the whole request (a failure would fall back to plain
        # decoding: lossless, so only this catches it)
        assert metrics.drafter_failures == 0 and proxy.state.drafters.failures == 0
        timings = got["timings"]
        if metrics.draft_tokens:
            assert timings["draft_n"] == metrics.draft_tokens
            assert timings["draft_n_accepted"] == metrics.accepted_tokens
        # the records are this request's verify rounds (and plain runs, if any)
        assert len(verify) == metrics.rounds
        assert sum(r.n_drafted for r in verify) == metrics.draft_tokens
        assert sum(r.n_accepted for r in verify) == metrics.accepted_tokens
        if drafter == "reference":
            # The same weights: every draft token is accepted, except where the target's
            # top-2 logits are so close that another float summation order (a GPU
            # backend's batch kernels) picks the other one. Each such rejection must be
            # proven a near-tie, with the rejected draft token among the top-2.
            rejected = await assert_rejections_are_near_ties(
                http, ref_server, prompt, got["tokens"], rounds, drafts
            )
            if not rejected:
                assert metrics.accepted_tokens == metrics.draft_tokens


def _shape_without_drafts(body: dict) -> dict:
    """llama-server alone reports no draft counters; the proxy adds them."""
    out = shape(body)
    out["timings"].pop("draft_n", None)
    out["timings"].pop("draft_n_accepted", None)
    out["timings"].pop("plain_run_n", None)
    return out


async def test_engine_one_decode_per_round(spec_server, reference_drafter, http, ref_server):
    """Engine-level: n_decode_total grows by exactly one per round, round by round."""
    prompt = await tokenize(http, ref_server, PROMPTS[1])
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": 30, "temperature": 0, "return_tokens": True},
    )
    k = 6
    drafts: dict[int, list[int]] = {}
    async with UpstreamClient(spec_server) as upstream:
        tokens, result = await generate(
            upstream,
            prompt,
            # Fixed draft length (the adaptive rule may cut drafts on measured timings
            # after three rounds): the rounds then follow from acceptance alone.
            GenerationParams(n_predict=30),
            RecordingDrafter(reference_drafter(), drafts),
            settings=EngineSettings(k=k, adaptive=False, check_decodes=True, strict_decodes=True),
        )
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    assert [r.decodes for r in result.rounds] == [1] * len(result.rounds)
    # The same weights: every draft is accepted unless the target's top-2 are a proven
    # near-tie (another float summation order, e.g. a GPU backend, may flip those).
    rejected = await assert_rejections_are_near_ties(
        http, ref_server, prompt, tokens, result.rounds, drafts
    )
    # Each round drafts k (fewer near the end) and commits its accepted drafts plus the
    # server's token: the rounds are exactly those these rejections imply.
    implied = implied_rounds(30, k, [r.position for r in rejected])
    assert [(r.n_drafted, r.n_accepted, r.n_committed) for r in result.rounds] == implied
    if not rejected:
        assert len(result.rounds) == 5  # 30 tokens, 7 per round with everything accepted
    # No re-prefill: each of the k+1 slots ingests at most the tokens committed last
    # round plus its share of the draft (idle-slot caching would make it hundreds).
    for previous, current in zip(result.rounds, result.rounds[1:], strict=False):
        bound = (k + 1) * previous.n_committed + k * (k + 1) // 2
        assert current.prompt_tokens <= bound, (current.prompt_tokens, bound)


async def test_streaming_equals_non_streaming_and_server(
    http, ref_server, spec_server, reference_drafter
):
    body = {"prompt": PROMPTS[0], "n_predict": 40, "temperature": 0, "stream": True}
    async with http.post(ref_server + "/completion", json=body) as response:
        ref_events, ref_done = parse_sse(await response.read())
    async with run_proxy(spec_server, reference_drafter, 4) as proxy:
        async with proxy.session.post(proxy.url + "/completion", json=body) as response:
            assert response.status == 200
            assert response.headers["X-Npu-Spec"] == "speculative"
            assert response.content_type == "text/event-stream"
            events, done = parse_sse(await response.read())
        _, plain, _ = await proxy.post("/completion", {**body, "stream": False})
    assert not done and not ref_done  # the native stream has no [DONE]
    assert [(e["content"], e.get("tokens")) for e in events[:-1]] == [
        (e["content"], e.get("tokens")) for e in ref_events[:-1]
    ]
    assert "".join(e["content"] for e in events) == plain["content"]
    final, ref_final = events[-1], ref_events[-1]
    assert final["stop"] is True and final["content"] == ""
    for key in ("stop_type", "stopping_word", "tokens_predicted", "truncated", "prompt"):
        assert final[key] == ref_final[key], key
    assert set(final) == set(ref_final)
    assert set(events[0]) == set(ref_events[0])


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_across_token_boundaries(
    http, ref_server, spec_server, reference_drafter, stream
):
    """A stop string that starts inside one token and ends in the next (and a second
    one that never occurs) stops where llama-server stops."""
    probe = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": PROMPTS[2], "n_predict": 30, "temperature": 0, "return_tokens": True},
    )
    pieces = []
    for token in probe["tokens"]:
        detok = await post_json(http, ref_server + "/detokenize", {"tokens": [token]})
        pieces.append(detok["content"])
    # the first boundary after token 5 where both sides have at least 2 characters
    i = next(j for j in range(5, len(pieces) - 1) if len(pieces[j]) >= 2 and pieces[j + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    body = {
        "prompt": PROMPTS[2],
        "n_predict": 30,
        "temperature": 0,
        "stop": ["never-occurs-xyz", stop],
        "stream": stream,
    }
    async with run_proxy(spec_server, reference_drafter, 8) as proxy:
        if stream:
            async with http.post(ref_server + "/completion", json=body) as response:
                expected, _ = parse_sse(await response.read())
            async with proxy.session.post(proxy.url + "/completion", json=body) as response:
                got, _ = parse_sse(await response.read())
            assert [e["content"] for e in got] == [e["content"] for e in expected]
            assert "timings" in got[-2] and "timings" in expected[-2]  # the stop chunk
            expected, got = expected[-1], got[-1]
        else:
            expected = await post_json(http, ref_server + "/completion", body)
            status, got, _ = await proxy.post("/completion", body)
            assert status == 200
            assert got["content"] == expected["content"]
    assert got["stop_type"] == expected["stop_type"] == "word"
    assert got["stopping_word"] == expected["stopping_word"] == stop
    assert got["tokens_predicted"] == expected["tokens_predicted"] == i + 2


async def test_context_limit_stops_where_server_stops(
    http, ref_server, spec_server, reference_drafter
):
    """No n_predict: generation runs into the slot's context and is truncated there."""
    prompt = (await tokenize(http, ref_server, PROMPTS[0] * 200))[: CTX - 21]
    body = {"prompt": prompt, "temperature": 0, "return_tokens": True}
    expected = await post_json(http, ref_server + "/completion", body)
    async with run_proxy(spec_server, reference_drafter, 8) as proxy:
        status, got, _ = await proxy.post("/completion", body)
    assert status == 200, got
    assert expected["truncated"] is True and expected["stop_type"] == "limit"
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
    for key in ("truncated", "stop_type", "tokens_predicted", "content"):
        assert got[key] == expected[key], key


async def test_prompt_longer_than_context_is_the_servers_error(
    http, ref_server, spec_server, reference_drafter
):
    prompt = (await tokenize(http, ref_server, PROMPTS[0] * 300))[: CTX + 10]
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    async with http.post(ref_server + "/completion", json=body) as response:
        ref_status, expected = response.status, await response.json()
    async with run_proxy(spec_server, reference_drafter, 4) as proxy:
        status, got, headers = await proxy.post("/completion", body)
        assert proxy.state.scheduler.active == 0
    assert status == ref_status == 400
    assert got == expected
    assert got["error"]["type"] == "exceed_context_size_error"
    assert headers["X-Npu-Spec"] == "speculative"


async def generate_with_copies(
    http, ref_server, spec_server, drafter, text: str, k: int, n_predict: int, **options
):
    """A 300-token prompt through the engine with slot copies on, its output checked
    against the server alone; the generation's result."""
    prompt = (await tokenize(http, ref_server, text * 60))[:300]
    expected = await post_json(
        http,
        ref_server + "/completion",
        {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True},
    )
    async with UpstreamClient(spec_server) as upstream:
        replicator = SlotReplicator(upstream)
        tokens, result = await generate(
            upstream,
            prompt,
            GenerationParams(n_predict=n_predict),
            drafter,
            # fixed k: the copies' tests count what the first rounds of k drafts ingest
            settings=EngineSettings(k=k, adaptive=False, check_decodes=True, strict_decodes=True),
            replicator=replicator,
            **options,
        )
    assert replicator.available
    await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], tokens)
    return prompt, result


async def test_cold_start_copies_the_prefilled_slot(
    spec_server, reference_drafter, http, ref_server
):
    """A long prompt is prefilled once and restored into the other k slots: the first
    verify batch then ingests a few tokens per slot, not k more prefills."""
    k = 4
    prompt, result = await generate_with_copies(
        http, ref_server, spec_server, reference_drafter(), PROMPTS[2], k, 16,
        slot_file="npu-spec-test-cold-start.bin",
    )  # fmt: skip
    first, second = result.rounds[0], result.rounds[1]
    assert first.n_drafted == 0 and first.n_committed == 1
    assert first.prompt_tokens <= len(prompt)  # one prefill (less if cached)
    assert second.n_drafted == k
    assert second.prompt_tokens <= (k + 1) * 1 + k * (k + 1) // 2, second
    assert all(r.decodes == 1 for r in result.rounds)


async def test_rounds_longer_than_the_copies_copy_before_verifying(
    spec_server, reference_drafter, http, ref_server
):
    """The first round copied its slot into one other only (the policy's measured need),
    and later rounds verify k + 1 prompts: the missing slots are copied before the
    batch, so no prompt of it prefills the whole context; output unchanged."""
    k = 3
    policies = EngineSettings(k=k, adaptive=False).policies().for_request(None)
    policies.draft_length.slots_to_copy = lambda: 1  # type: ignore[method-assign]
    _prompt, result = await generate_with_copies(
        http, ref_server, spec_server, reference_drafter(), PROMPTS[1], k, 12,
        slot_file="npu-spec-test-warm-for.bin", policies=policies,
    )  # fmt: skip
    second = result.rounds[1]
    assert second.n_drafted == k and second.catch_up  # copied for it, not steady
    assert second.prompt_tokens <= (k + 1) * 1 + k * (k + 1) // 2, second
    assert all(not r.catch_up for r in result.rounds[2:])


@pytest.mark.parametrize("overlap", ["on", "off"])
async def test_drafting_ahead_is_reused_and_lossless(
    http, ref_server, spec_server, drafter_for, overlap
):
    """With the target's own weights every block and bonus guess hits, so drafts made
    during verification are handed out by the next round instead of recomputed."""
    body = {"prompt": PROMPTS[1], "n_predict": 48, "temperature": 0, "return_tokens": True}
    expected = await post_json(http, ref_server + "/completion", body)
    prompt = await tokenize(http, ref_server, PROMPTS[1])
    async with run_proxy(
        spec_server, drafter_for("reference"), 4, check_decodes=True, overlap=overlap
    ) as proxy:
        status, got, _ = await proxy.post("/completion", body)
        assert status == 200, got
        await assert_greedy_equal(http, ref_server, prompt, expected["tokens"], got["tokens"])
        metrics = proxy.state.metrics
        assert metrics.decode_check_failures == 0
        assert (metrics.reused_tokens > 0) == (overlap == "on")
        async with http.get(proxy.url + "/metrics") as response:
            page = await response.text()
        assert f"npu_spec_drafting_ahead {1 if overlap == 'on' else 0}\n" in page
        assert "npu_spec_draft_calibration " in page  # measured rounds exist


async def test_mismatch_explained_by_the_servers_top2(http, ref_server):
    from proxy.bench.neartie import explain_mismatch, top2_gap

    prompt = await tokenize(http, ref_server, PROMPTS[0])
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "return_tokens": True}
    expected = (await post_json(http, ref_server + "/completion", body))["tokens"]
    ids, gap = await top2_gap(http, ref_server, prompt + expected[:1])
    assert ids[0] == expected[1] and gap >= 0
    outsider = next(t for t in range(100, 200) if t not in ids)
    report = await explain_mismatch(
        http, ref_server, prompt, expected, [expected[0], outsider], 1, margin=1e9
    )
    assert report["top2"] == ids and not report["near_tie"]  # not even a candidate
    runner_up = [expected[0], ids[1]]
    assert (await explain_mismatch(http, ref_server, prompt, expected, runner_up, 1, 1e9))[
        "near_tie"
    ]
    tight = await explain_mismatch(http, ref_server, prompt, expected, runner_up, 1, gap / 2)
    assert not tight["near_tie"] or gap == 0
