"""scripts/round_log_summary.py: `--log-rounds` lines grouped by drafts and padding."""

from __future__ import annotations

import json

from tests.support.scripts import load_script


def _line(i: int, k: int, slots: list[int], pad: int, server_ms: float, **flags) -> str:
    record = {"i": i, "n_drafted": k, "server_ms": server_ms, "verify_ms": server_ms + 3,
              "catch_up": False, "copied": False, "pad": pad,
              "slots": [[n, tokens, 500, server_ms] for n, tokens in enumerate(slots)],
              **flags}  # fmt: skip
    return "2026-12-04 22:00:00,000 DEBUG proxy.engine.rounds.log: round " + json.dumps(record)


def test_steady_rounds_are_grouped_by_drafts_and_padding_with_their_batch_sizes():
    summary = load_script("round_log_summary")
    lines = [
        _line(0, 0, [513], 0, 40.0),  # the first round: not steady
        _line(1, 2, [1, 2, 3], 0, 15.0, catch_up=True),  # caught up: not steady
        _line(2, 2, [1, 2, 3], 0, 15.0),
        _line(3, 2, [2, 3, 4], 0, 16.0),
        _line(4, 2, [1, 2, 3], 4, 14.0),
        _line(5, 2, [2, 3, 4], 1, 14.5),
        "2026-12-04 22:00:00,000 INFO proxy.api: something else",
    ]
    rows = summary.summary(summary.rounds_of(lines))
    assert rows == [
        {"k": 2, "padded": False, "rounds": 2, "batch_sizes": {6: 1, 9: 1},
         "server_ms": 15.5, "verify_ms": 18.5},
        {"k": 2, "padded": True, "rounds": 2, "batch_sizes": {10: 2},
         "server_ms": 14.25, "verify_ms": 17.25},
    ]  # fmt: skip
