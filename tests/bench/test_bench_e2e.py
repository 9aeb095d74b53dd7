"""`npu-spec bench` end to end on CPU with the small factory models.

Asserts only that the session completes, that the JSON holds the documented
fields, and that every mode wrote what plain llama-server writes: never a speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from proxy import bench_cmd
from proxy.bench.cli import options_from_args
from proxy.bench.report import render_table
from proxy.bench.runner import RESULT_FIELDS, RUN_FIELDS, BenchOptions, run_bench, write_json

SUMMARY_FIELDS = (
    "tokens_per_s_median", "tokens_per_s_min", "tokens_per_s_max", "tokens_per_s_repeats",
    "ttft_ms_median", "n_runs", "n_equal_to_plain", "n_exact_checked", "n_speculative",
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
         "--oracle-delay-ms", "11", "--modes", "plain,oracle", "--repeats", "2"]
    )  # fmt: skip
    options = options_from_args(args)
    assert options.target == tmp_path / "target.gguf"
    assert options.drafter == tmp_path / "draft"
    assert options.ks == [2, 4, 6, 8]
    assert options.contexts == [None, 512, 4096]
    assert options.server_args == ["-ngl", "99", "-fa", "on"]
    assert options.oracle_acceptance == [0.6, 0.8]
    assert options.modes == ["plain", "oracle"]
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
        modes=["plain", "builtin", "proxy", "oracle"],
        ks=[3],
        contexts=[192],  # exercises padding and the long prompt, kept short for CPU
        repeats=1,
        n_predict=12,
        prompt_ids=["edit-bugfix", "long-report"],
        threads=1,
        provider="cpu",
        oracle_acceptance=[0.7],
        oracle_delay_ms=1.0,
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
    modes = [e["kind"] for e in result["summary"]]
    assert modes == ["plain", "builtin", "proxy", "oracle"]
    assert len(result["runs"]) == 4 * 2
    for run in result["runs"]:
        assert tuple(run) == RUN_FIELDS
        assert run["n_generated"] > 0
        assert run["exact_checked"]  # token for token, not only what the stream shows
        assert run["equal_to_plain"], f"{run['mode']} {run['prompt']}: {run['first_mismatch']}"
    for entry in result["summary"]:
        summary = entry["summary"]
        assert set(SUMMARY_FIELDS) <= set(summary)
        assert summary["n_equal_to_plain"] == summary["n_runs"] == 2
        assert summary["memory"]["rss_mb.llama-server"] > 0
        if entry["kind"] in ("proxy", "oracle"):
            assert set(SPEC_FIELDS) <= set(summary)
            assert summary["n_speculative"] == 2  # the speculative path really ran
            assert summary["drafter_failures"] == 0
            assert summary["memory"]["rss_mb.proxy"] > 0
        if entry["kind"] == "oracle":  # on its reference path it drafts every round
            assert summary["drafted"] >= summary["rounds"] - 2  # but each prompt's last
        if entry["kind"] == "builtin":
            assert summary["drafted"] > 0
    table = render_table(result)
    assert "oracle(a=0.7,1ms)" in table and "builtin" in table
