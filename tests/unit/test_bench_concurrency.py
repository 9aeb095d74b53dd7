"""`npu-spec bench --concurrency`: the table's numbers from stream results (no server)."""

from __future__ import annotations

import pytest

from proxy.bench.concurrency import StreamResult, percentile, render, summarise


def _stream(prompt: int, ttft: float, end: float, tokens: int, text: str = "x") -> StreamResult:
    return StreamResult(prompt=prompt, ttft_s=ttft, end_s=end, tokens=tokens, text=text)


def test_summary_of_bursts():
    bursts = [
        [_stream(0, 0.1, 1.1, 11), _stream(1, 0.3, 2.3, 21, "other")],
        [_stream(0, 0.2, 1.2, 11), StreamResult(prompt=1, error="HTTP 503")],
    ]
    row = summarise(bursts, {0: "x", 1: "y"})
    assert row["streams"] == 4 and row["errors"] == 1
    assert row["aggregate_tok_s"] == pytest.approx(((11 + 21) / 2.3 + 11 / 1.2) / 2)
    assert row["ttft_p50_s"] == 0.2 and row["ttft_p95_s"] == 0.3
    assert row["stream_tok_s_mean"] == pytest.approx(10.0)  # (tokens - 1) / streaming time
    assert row["equal_to_solo"] == 2  # prompt 1's text differs from its solo answer
    assert row["error_samples"] == ["HTTP 503"]


def test_percentile_and_table_ratios():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.95) == 3.0
    row = {"streams": 2, "errors": 0, "aggregate_tok_s": 10.0, "ttft_p50_s": 0.1,
           "ttft_p95_s": 0.2, "stream_tok_s_mean": 5.0, "equal_to_solo": 2}  # fmt: skip
    result = {
        "options": {"slots": 6, "k": 4, "n_predict": 64, "repeats": 1},
        "rows": [
            {"system": "llama-server", "n": 2, **row},
            {"system": "proxy", "n": 2, **row, "aggregate_tok_s": 12.0, "ttft_p95_s": 0.22,
             "proxy_metrics": {"npu_spec_speculation_yields_total": 1.0}},
        ],
    }  # fmt: skip
    table = render(result)
    assert "| proxy | 2 | 12.00 | 1.20x |" in table and "| 1.10x |" in table
    assert "| 1/0 |" in table
