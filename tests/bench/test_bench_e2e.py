"""`npu-spec bench` end to end on CPU with the small factory models.

Asserts only that the session completes, that the JSON holds the documented
fields (the ceiling columns and row keys of issue 16 among them), and that every mode
but builtin-synth wrote what plain llama-server writes: never a speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from proxy import bench_cmd
from proxy.bench.cli import options_from_args
from proxy.bench.modes import synth_rates
from proxy.bench.report import render_table
from proxy.bench.runner import RESULT_FIELDS, RUN_FIELDS, BenchOptions, run_bench, write_json
from proxy.bench.stats import ROW_KEYS

SUMMARY_FIELDS = (
    "tokens_per_s_median", "tokens_per_s_min", "tokens_per_s_max", "tokens_per_s_repeats",
    "ttft_ms_median", "first_n_ms_median", "n_runs", "n_equal_to_plain", "n_exact_checked",
    "n_speculative",
    "rounds", "drafted",
    "accepted", "acceptance", "accepted_per_round", "tokens_per_round", "decodes_per_round",
    "memory",
)  # fmt: skip
SPEC_FIELDS = (
    "acceptance_per_position", "acceptance_iid", "draft_ms_per_round", "verify_ms_per_round",
    "overhead_ms_per_round", "draft_ms_per_token", "predicted", "measured_over_predicted",
)  # fmt: skip


def test_cli_options_parse(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    args = parser.parse_args(
        ["--models", str(tmp_path), "-k", "2,4,6,8", "--context", "natural,512,4k",
         "--server-args=-ngl 99 -fa on", "--oracle-acceptance", "0.6,0.8",
         "--oracle-delay-ms", "11", "--modes", "plain,oracle,builtin-synth", "--repeats", "2",
         "--oracle-delay-steps", "0.12,0.27", "--ceiling-ks", "1,2,4"]
    )  # fmt: skip
    options = options_from_args(args)
    assert options.target == tmp_path / "target.gguf"
    assert options.drafter == tmp_path / "draft"
    assert options.ks == [2, 4, 6, 8]
    assert options.contexts == [None, 512, 4096]
    assert options.server_args == ["-ngl", "99", "-fa", "on"]
    assert options.oracle_acceptance == [0.6, 0.8]
    assert options.modes == ["plain", "oracle", "builtin-synth"]
    assert options.oracle_delay_steps == [0.12, 0.27]
    assert options.ceiling_ks == [1, 2, 4]
    assert options.draft_shape == "core"  # no manifest.json in tmp_path
    (tmp_path / "manifest.json").write_text(json.dumps({"draft_shape": "qwen3-0.6b"}))
    assert options_from_args(args).draft_shape == "qwen3-0.6b"
    with pytest.raises(SystemExit):
        parser.parse_args(["--modes", "plain,turbo"])


@pytest.mark.server
@pytest.mark.slow
async def test_bench_all_modes_complete_and_match_plain(
    llama_server_bin: Path, make_models_dir, tmp_path: Path
) -> None:
    models = make_models_dir("noisy:0.05")
    options = BenchOptions(
        target=models / "target.gguf",
        draft_gguf=models / "draft.gguf",
        drafter=models / "draft",
        modes=["plain", "builtin", "builtin-synth", "proxy", "oracle"],
        ks=[3],
        contexts=[192],  # exercises padding and the long prompt, kept short for CPU
        repeats=1,
        n_predict=12,
        prompt_ids=["edit-bugfix", "long-report"],
        threads=1,
        provider="cpu",
        oracle_acceptance=[0.7],
        oracle_delay_steps=[0.1],  # of the plain step measured at this context
        ceiling_ks=[1, 2, 3],
        ceiling_repeats=2,
        llama_server=llama_server_bin,
        work_dir=tmp_path / "work",
        # 12 tokens a request: plain runs (the default) would take over after the first
        # few rounds, and this test is about the speculative rounds' fields
        proxy_variants=[("", ["--plain-runs", "off"])],
    )
    result = await run_bench(options)
    out = tmp_path / "bench.json"
    write_json(result, out)
    result = json.loads(out.read_text())

    assert tuple(result) == RESULT_FIELDS
    assert result["errors"] == []
    assert [r["prompt"] for r in result["references"]] == ["edit-bugfix", "long-report"]
    assert all(150 <= r["n_prompt"] <= 230 for r in result["references"])
    # near-tie branches for the oracle (few or none at the real margin on this model)
    assert all(len(r["branches"]) <= options.oracle_branches for r in result["references"])
    costs = result["round_costs"]["192"]
    assert costs["plain_ms"] > 0
    assert sorted(costs["round_ms"]) == ["1", "2", "3"]
    assert all(ms > 0 for ms in costs["round_ms"].values())
    modes = [e["kind"] for e in result["summary"]]
    assert modes == ["plain", "builtin", "builtin-synth", "proxy", "oracle"]
    for instance in result["instances"]:  # warmed up at the context, on another prompt
        warmup = instance["warmup"]
        assert warmup["prompt"] not in options.prompt_ids, warmup
        assert 150 <= warmup["n_prompt"] <= 230 and warmup["n_generated"] > 0
    # the oracle knows the warm-up prompt's output too: its warm-up drafts like a real one
    (oracle_folder,) = (tmp_path / "work").glob("oracle-*")
    references = json.loads((oracle_folder / "oracle.json").read_text())["references"]
    assert len(references) == 3 and len(references[2][0]) == warmup["n_prompt"]
    assert len(result["runs"]) == 5 * 2
    for run in result["runs"]:
        assert tuple(run) == RUN_FIELDS
        assert run["n_generated"] > 0
        # the 32nd token's time only where 32 came
        if run["n_generated"] < 32:
            assert run["first_n_ms"] is None
        else:
            assert run["ttft_ms"] < run["first_n_ms"] <= run["total_ms"]
        if run["kind"] == "builtin-synth":  # benchmarking only: never compared
            assert run["equal_to_plain"] is None and not run["valid_output"]
            continue
        assert run["exact_checked"]  # token for token, not only what the stream shows
        assert run["equal_to_plain"], f"{run['mode']} {run['prompt']}: {run['first_mismatch']}"
    rows = {e["kind"]: e for e in result["summary"]}
    for entry in result["summary"]:
        summary = entry["summary"]
        assert set(SUMMARY_FIELDS) <= set(summary)
        assert set(ROW_KEYS) <= set(entry)
        assert entry["plain_tok_s"] == rows["plain"]["tok_s"] > 0
        if entry["kind"] == "plain":
            assert entry["ideal_tok_s"] is None and entry["draft_shape"] is None
            continue
        # every drafting row: its acceptance, both ceilings and its drafter's cost
        assert 0 <= entry["acceptance"] <= 1
        assert entry["ideal_tok_s"] > 0 and entry["ideal_k"] in (1, 2, 3)
        assert entry["draft_ms_per_token"] >= 0, entry["overlap_note"]
        assert 0 < entry["overlap_tok_s"] <= entry["ideal_tok_s"] * (1 + 1e-9)
        assert entry["meas_over_overlap"] == pytest.approx(entry["tok_s"] / entry["overlap_tok_s"])
        assert entry["draft_shape"] == ("oracle" if entry["kind"] == "oracle" else "core")
        if entry["kind"] == "builtin-synth":
            assert summary["n_compared"] == 0 and not entry["output_valid"]
            continue
        assert summary["n_equal_to_plain"] == summary["n_runs"] == 2
        assert summary["memory"]["rss_mb.llama-server"] > 0
        if entry["kind"] in ("proxy", "oracle"):
            assert set(SPEC_FIELDS) <= set(summary)
            assert summary["n_speculative"] == 2  # the speculative path really ran
            assert summary["drafter_failures"] == 0
            assert summary["memory"]["rss_mb.proxy"] > 0
        if entry["kind"] == "oracle":  # on its reference path it drafts every round
            assert summary["drafted"] >= summary["rounds"] - 2  # but each prompt's last
            assert summary["empty_draft_rounds"] <= 2  # never off its recorded paths
        if entry["kind"] == "builtin":
            assert summary["drafted"] > 0
    # llama.cpp's own drafter timer, from its log (-lv 4)
    assert rows["builtin"]["summary"]["draft_ms_per_token"] > 0
    assert rows["builtin-synth"]["summary"]["draft_ms_per_token"] > 0
    oracle = rows["oracle"]
    assert oracle["oracle_delay_steps"] == 0.1
    assert oracle["oracle_delay_ms"] == pytest.approx(0.1 * costs["plain_ms"])
    assert oracle["draft_ms_per_token"] == oracle["oracle_delay_ms"]
    # the server really accepted at random: its own log says so, with our rates
    synth_log = (tmp_path / "work" / "logs" / "ctx192-k3-r0-builtin-synth-a0.7.log").read_text()
    assert "generated output is not valid" in synth_log
    assert f"rates = [{synth_rates(0.7, 3).replace(',', ', ')}]" in synth_log
    table = render_table(result)
    assert oracle["mode"] in table and "builtin-synth(a=0.7)" in table
    assert "not valid" in table and "meas/overlap" in table
