"""The bench report's oracle rows counted on the oracle's recorded path only
(proxy.bench.report.on_path_lines)."""

from __future__ import annotations

import pytest

from proxy.bench.report import on_path_lines, render_table


def _run(kind: str, mode: str, prompt: str, tok_s: float, rounds: int = 40, empty: int = 0):
    return {"kind": kind, "mode": mode, "context": 512, "k": 0 if kind == "plain" else 6,
            "prompt": prompt, "tokens_per_s": tok_s,
            "stats": {"rounds": rounds, "empty_draft_rounds": empty}}  # fmt: skip


def test_runs_off_the_path_are_left_out_and_each_run_is_set_against_its_prompts_plain():
    runs = [
        _run("plain", "plain", "a", 100.0), _run("plain", "plain", "a", 110.0),
        _run("plain", "plain", "b", 80.0),
        _run("oracle", "pad", "a", 105.0, empty=8),  # 8 of 40: still on the path
        _run("oracle", "pad", "b", 60.0, rounds=93, empty=76),  # off it
        _run("oracle", "off", "a", 94.5), _run("oracle", "off", "b", 88.0),
    ]  # fmt: skip
    lines = on_path_lines({"runs": runs})
    assert lines[1:] == [
        "  512 k=6 pad: 1/2 runs, median 1.00x plain",
        "  512 k=6 off: 2/2 runs, median 1.00x plain",
    ]
    assert "20%" in lines[0]


def test_no_lines_where_every_oracle_run_stayed_on_the_path():
    runs = [_run("plain", "plain", "a", 100.0), _run("oracle", "off", "a", 94.5, empty=2)]
    assert on_path_lines({"runs": runs}) == []
    table = render_table({"summary": [], "runs": runs})
    assert "oracle's path" not in table


@pytest.mark.parametrize("rounds, empty, kept", [(5, 2, 1), (5, 3, 0), (100, 20, 1), (100, 21, 0)])
def test_the_path_allows_two_empty_rounds_or_a_fifth(rounds, empty, kept):
    runs = [
        _run("plain", "plain", "a", 100.0),
        _run("oracle", "x", "a", 90.0, rounds=rounds, empty=empty),
        _run("oracle", "x", "a", 90.0, rounds=40, empty=30),
    ]
    assert on_path_lines({"runs": runs})[1].startswith(f"  512 k=6 x: {kept}/2 runs")
