"""Pure parts of the harness: scheduling of modes, comparisons, per-request stats."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import aiohttp

from proxy.bench.runner import (
    BenchOptions,
    first_mismatch,
    mode_specs,
    mode_units,
    rotated,
)
from proxy.bench.stats import request_stats, summarize


def test_modes_of_a_k_group_and_their_rotation() -> None:
    options = BenchOptions(target=Path("t.gguf"), oracle_acceptance=[0.6, 0.9], oracle_delay_ms=11)
    specs = mode_specs(options, 4)
    assert [s.name for s in specs] == [
        "plain", "builtin", "proxy", "oracle(a=0.6,11ms)", "oracle(a=0.9,11ms)",
    ]  # fmt: skip
    assert specs[0].k == 0 and all(s.k == 4 for s in specs[1:])
    assert mode_specs(options, 4, with_plain=False)[0].kind == "builtin"
    units = mode_units(specs)
    assert units[:2] == specs[:2]
    assert units[2] == specs[2:]  # proxy and oracles share one verification server
    assert rotated([1, 2, 3], 1) == [2, 3, 1]
    assert rotated([1, 2, 3], 5) == [3, 1, 2]
    assert rotated([], 3) == []


def test_proxy_variants_multiply_proxy_and_oracle_modes() -> None:
    from proxy.bench.cli import _variant

    turns = _variant("turns=--fixed-k --no-overlap")
    assert turns == ("turns", ["--fixed-k", "--no-overlap"])
    options = BenchOptions(
        target=Path("t.gguf"), modes=["plain", "proxy", "oracle"], proxy_variants=[("", []), turns]
    )
    specs = mode_specs(options, 6)
    assert [s.name for s in specs] == [
        "plain", "proxy", "proxy[turns]", "oracle(a=0.8,0ms)", "oracle(a=0.8,0ms)[turns]",
    ]  # fmt: skip
    assert specs[2].serve_args == ("--fixed-k", "--no-overlap")
    # the real drafter only in the variants asked for; the oracle in all
    options.proxy_mode_variants = [""]
    assert [s.name for s in mode_specs(options, 6)] == [
        "plain", "proxy", "oracle(a=0.8,0ms)", "oracle(a=0.8,0ms)[turns]",
    ]  # fmt: skip
    # and the oracle only in its own (the real drafter and the oracle in one run)
    options.oracle_mode_variants = ["turns"]
    assert [s.name for s in mode_specs(options, 6)] == [
        "plain", "proxy", "oracle(a=0.8,0ms)[turns]",
    ]  # fmt: skip


def test_runner_up_hits_multiply_oracle_modes_only() -> None:
    """--oracle-runner-up-hits: one oracle mode (and oracle folder) per share of misses
    it covers; its name says the share where it is not 0."""
    options = BenchOptions(
        target=Path("t.gguf"), modes=["plain", "builtin-synth", "oracle"],
        oracle_delay_ms=11, oracle_runner_up_hits=[0.0, 0.42],
    )  # fmt: skip
    specs = mode_specs(options, 1)
    assert [s.name for s in specs] == [
        "plain", "builtin-synth(a=0.8)", "oracle(a=0.8,11ms)", "oracle(a=0.8,11ms,ru=0.42)",
    ]  # fmt: skip
    assert [s.runner_up_hits for s in specs[2:]] == [0.0, 0.42]
    from proxy.bench.runner import _log_name

    trial = SimpleNamespace(context=512, repeat=0)
    assert _log_name(trial, specs[2]) != _log_name(trial, specs[3])  # logs kept apart


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 9, 3], [1, 2, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def _proxy_metrics(rounds: int, drafted: int, accepted: int, decodes: int, ms: float) -> dict:
    return {
        "npu_spec_rounds_total": rounds,
        "npu_spec_draft_tokens_total": drafted,
        "npu_spec_accepted_tokens_total": accepted,
        'npu_spec_draft_tokens_per_position_total{position="0"}': rounds,
        'npu_spec_draft_tokens_per_position_total{position="1"}': drafted - rounds,
        'npu_spec_accepted_tokens_per_position_total{position="0"}': accepted,
        'npu_spec_accepted_tokens_per_position_total{position="1"}': 0,
        "npu_spec_draft_ms_sum": ms,
        "npu_spec_verify_ms_sum": 2 * ms,
        "npu_spec_overhead_ms_sum": 0.1 * ms,
        "llamacpp:n_decode_total": decodes,
    }


def test_proxy_request_stats_leave_the_first_round_out_of_the_split() -> None:
    before = _proxy_metrics(0, 0, 0, 0, 0.0)
    first = _proxy_metrics(1, 2, 1, 3, 50.0)  # the first round also prefilled
    after = _proxy_metrics(11, 22, 11, 13, 150.0)
    after["npu_spec_empty_draft_rounds_total"] = 3  # rounds the drafter proposed nothing for
    stats = request_stats("proxy", 2, 30, before, first, after)
    assert (stats["rounds"], stats["drafted"], stats["accepted"]) == (11, 22, 11)
    assert stats["empty_draft_rounds"] == 3 and stats["steady"]["empty_draft_rounds"] == 3
    assert stats["drafted_per_position"] == [11, 11]
    assert stats["accepted_per_position"] == [11, 0]
    assert stats["steady"]["rounds"] == 10 and stats["steady"]["decodes"] == 10
    run = {"repeat": 0, "n_generated": 30, "decode_ms": 1000.0, "ttft_ms": 5.0,
           "equal_to_plain": True, "exact_checked": True, "spec_header": "speculative",
           "stats": stats}  # fmt: skip
    summary = summarize("proxy", 2, [run], [{"rss_mb.proxy": 100.0}])
    assert summary["tokens_per_s_median"] == 29.0
    assert summary["decodes_per_round"] == 1.0
    assert summary["empty_draft_rounds"] == 3
    assert summary["draft_ms_per_round"] == 10.0 and summary["verify_ms_per_round"] == 20.0
    assert summary["acceptance_per_position"] == [1.0, 0.0]
    assert summary["acceptance_iid"] == 0.5
    assert summary["predicted"]["tokens_per_round"] == 1.75
    assert summary["memory"] == {"rss_mb.proxy": 100.0}


def test_builtin_and_plain_request_stats() -> None:
    before = {"llamacpp:n_decode_total": 5}
    after = {
        "llamacpp:n_decode_total": 17,
        "llamacpp:spec_decode_num_drafts_total": 10,
        "llamacpp:spec_decode_num_draft_tokens_total": 40,
        "llamacpp:spec_decode_num_accepted_tokens_total": 20,
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 8,
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 6,
    }
    stats = request_stats("builtin", 4, 30, before, {}, after)
    assert stats["rounds"] == 10 and stats["decodes"] == 12
    assert stats["drafted_per_position"] == [10, 10, 10, 10]
    assert stats["accepted_per_position"] == [8, 6]
    plain = request_stats("plain", 0, 30, before, {}, after)
    assert plain == {"rounds": 30, "drafted": 0, "accepted": 0, "decodes": 12}


async def test_a_streamed_pass_through_is_not_timed_beside_a_metrics_poll():
    """A pass-through counts no round: the client reads the metrics before, at the first
    token and after, and never polls for a round while the server decodes (on 2 cores
    that poll held pass-through chats at 0.70-0.77x plain). A speculative answer is
    polled until its first round shows."""
    import asyncio
    import json

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from proxy.bench.client import PASSTHROUGH, SPEC_HEADER, stream_completion

    async def scenario(header: str) -> int:
        reads = 0

        async def metrics(_request: web.Request) -> web.Response:
            nonlocal reads
            reads += 1
            rounds = 1 if header != PASSTHROUGH and reads > 5 else 0
            return web.Response(text=f"npu_spec_rounds_total {rounds}\n")

        async def completion(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={SPEC_HEADER: header})
            await response.prepare(request)
            for token in range(20):
                event = {"tokens": [token], "content": "x", "stop": token == 19}
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(0.005)
            return response

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/completion", completion)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            base = str(server.make_url("")).rstrip("/")
            done = await stream_completion(
                session, base, [1, 2, 3], 20, base + "/metrics", "npu_spec_rounds_total"
            )
        assert len(done.tokens) == 20
        return reads

    assert await scenario(PASSTHROUGH) == 3
    assert await scenario("speculative") == 7  # before, 5 until the round shows, after
