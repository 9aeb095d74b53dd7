"""scripts/verify_cost.py end to end on CPU with the small factory models.

Asserts that the session completes, that the JSON holds every row asked for, and
that each k+1-prompt verify round took exactly one llama_decode (what -kvu buys):
never a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.bench.verify_cost import (
    Variant,
    expected_round_tokens,
    parse_variant,
    percentile,
)
from tests.conftest import SERVER_THREADS

REPO = Path(__file__).resolve().parents[2]


def test_options_and_helpers() -> None:
    assert parse_variant("fa-off=-ngl 99 -fa off") == Variant(
        "fa-off", ["-ngl", "99", "-fa", "off"]
    )
    assert parse_variant("cpu=") == Variant("cpu", [])
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert expected_round_tokens(1, 0) == 3
    assert expected_round_tokens(4, 2) == 18  # 15 for the new tokens, 3 for short slots


@pytest.mark.server
@pytest.mark.slow
def test_verify_cost_runs_and_rounds_take_one_decode(
    llama_server_bin: Path, demo_models: Path, tmp_path: Path
) -> None:
    out = tmp_path / "verify-cost.json"
    command = [
        sys.executable, str(REPO / "scripts" / "verify_cost.py"),
        "--models", str(demo_models),
        "--variant", "base=",
        "--context", "128",
        "-k", "1,2",
        "--new-tokens", "1,3",
        "--np-large", "4",
        "--np-ks", "1",  # e: -np 2 vs -np 4 with two idle slots full
        "--repeats", "1",
        "--warmup", "1",
        "--plain-tokens", "8",
        "-t", SERVER_THREADS,
        "--llama-server", str(llama_server_bin),
        "--work-dir", str(tmp_path / "work"),
        "-o", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| variant | ctx | what |" in done.stdout

    result = json.loads(out.read_text())
    assert result["schema"] == "npu-spec-verify-cost/1"
    assert result["errors"] == []
    assert [(s["np"], s["context"]) for s in result["servers"]] == [(4, 128), (2, 128), (1, 128)]
    rows = {row["what"]: row for row in result["rows"]}
    assert set(rows) == {
        "a: plain decoding, ms/token",
        "b: 1 slot, +1 token",
        "c: 1 slot, +3 tokens",
        "d: k=1, k+1 prompts",
        "d: k=2, k+1 prompts",
        "e: k=1, -np 4, idle slots full",
        "e: k=2, -np 4, idle slots full",
        "e: k=1, -np 2",
        "f: cold prefill, save, restore",
        "g: f, other slots full",
        "h: k=1, after 0 accepted",
        "h: k=1, after 1 accepted",
        "h: k=2, after 0 accepted",
        "h: k=2, after 1 accepted",
        "h: k=2, after 2 accepted",
        "m: k=1, after 0..1 accepted in turn",
        "m: k=2, after 0..2 accepted in turn",
        "i: plain server, a new prompt after another",
    }
    for row in result["rows"]:
        assert row["variant"] == "base" and row["context"] == 128
        assert row["n"] == len(row["samples"]) == 1
        assert row["ms_median"] > 0
    for what in ("b: 1 slot, +1 token", "c: 1 slot, +3 tokens"):
        assert rows[what]["decodes_per_round"] == 1
        assert rows[what]["server_ms_median"] > 0
    # f: a whole cold prefill in one slot, then a copy of it (the regime files' source)
    (cold,) = rows["f: cold prefill, save, restore"]["samples"]
    assert cold["tokens"] == 128 and cold["cached"] == 0 and cold["n_saved"] == 128
    assert cold["save_wall_ms"] > 0 and cold["restore_wall_ms"] > 0
    # g: the same with the other three slots full: a cold prefill, not a cached one
    (full,) = rows["g: f, other slots full"]["samples"]
    assert full["tokens"] == 128 and full["cached"] == 0 and full["n_saved"] == 128
    assert full["results"][0]["id_slot"] == 0
    # i: on a plain server (one slot, the RAM prompt cache on) a fresh prompt while the
    # slot held another: prefilled whole, after the server cached the old one
    (switch,) = rows["i: plain server, a new prompt after another"]["samples"]
    assert switch["tokens"] == 128 and switch["cached"] == 0 and switch["n_saved"] == 128
    assert switch["save_ms"] < switch["ms"] and switch["cold_ms"] > 0
    assert "-np" in (plain := result["servers"][-1]["command"]) and "-kvu" not in plain
    # the claim the proxy rests on: k+1 prompts in one request are one llama_decode
    verify_rows = [r for r in result["rows"] if r["part"] in ("d", "e", "h", "m")]
    assert len(verify_rows) == 12
    # h: what a round ingests after j accepted, as the server counts it: the triangle
    # plus every slot's catch-up (the ceiling's t_v(k) weights these by the acceptance)
    for row in (r for r in verify_rows if r["part"] == "h"):
        assert row["tokens_per_round"] == row["expected_tokens"], row["what"]
        assert row["expected_tokens"] == expected_round_tokens(row["k"], row["accepted"])
    # m: the number accepted changes every round, and with it what the round ingests
    for row in (r for r in verify_rows if r["part"] == "m"):
        tokens = [s["tokens"] for s in row["samples"]]
        assert tokens == [expected_round_tokens(row["k"], j % (row["k"] + 1))
                          for j in range(1, 1 + len(tokens))], row["what"]  # fmt: skip
    for row in verify_rows:
        for sample in row["samples"]:
            assert sample["decodes"] == 1, (row["what"], sample)
            assert len(sample["results"]) == row["k"] + 1
        assert row["server_ms_median"] > 0
