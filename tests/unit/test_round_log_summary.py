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


def _verdict_lines(k: int, padded_ms: float, unpadded_ms: float, n: int, logged: bool):
    """n padded and n unpadded rounds of k drafts after a first round; `logged`: the
    logs name the rounds that could have been padded (else inferred, older logs)."""
    lines = [_line(0, 0, [513], 0, 40.0, n_accepted=0, draft_ms=0.0, overhead_ms=0.0)]
    for i in range(1, 2 * n + 1):
        padded = i > n
        flags = {"padded": padded} if logged else {}
        lines.append(_line(
            i, k, [1, 2, 3], 4 if padded else 0, (padded_ms if padded else unpadded_ms) - 3,
            n_accepted=1, draft_ms=1.0, overhead_ms=0.5, **flags,
        ))  # fmt: skip
    return lines


def test_the_verdict_replays_the_rounds_through_the_padding_policy():
    summary = load_script("round_log_summary")
    for logged in (True, False):
        # H200-like: padding saves 3.8 ms of 22.5 at 3 drafts; H100-like: it loses at 5
        h200 = summary.could_pad(summary.rounds_of(_verdict_lines(3, 18.7, 22.5, 20, logged)))
        assert len(h200) == 40 - (not logged)  # older logs: the first unpadded round is not known
        assert summary.padding_verdict(h200).padded_lengths() == [3]
        h100 = summary.could_pad(summary.rounds_of(_verdict_lines(5, 26.2, 25.5, 20, logged)))
        policy = summary.padding_verdict(h100)
        assert policy.padded_lengths() == [] and policy.lengths[5].chosen is False


def test_the_verdict_prints_each_length_and_its_choice(tmp_path, capsys):
    summary = load_script("round_log_summary")
    log = tmp_path / "rounds.log"
    log.write_text("\n".join(_verdict_lines(3, 18.7, 22.5, 20, True)))
    assert summary.main(["--verdict", str(log)]) == 0
    out = capsys.readouterr().out
    assert "padded lengths: [3]" in out and "k=3" in out and "-> padded" in out


def test_generations_part_the_first_round_and_its_copies_from_the_steady_speed(tmp_path, capsys):
    summary = load_script("round_log_summary")

    def generation(cached: int, first_ms: float, copies: list | None) -> list[str]:
        flags = {"n_accepted": 0, "round_ms": first_ms}
        if copies is not None:
            flags["copies"] = copies
        first = _line(0, 0, [513 - cached], 0, 40.0, **flags)
        first = first.replace("500, 40.0]", f"{cached}, 40.0]")
        # 10 rounds of 2 drafts, 2 accepted each (3 tokens a round), 20 ms each; 1 empty
        rest = [_line(i, 2, [1, 2, 3], 0, 15.0, n_accepted=2, round_ms=20.0) for i in range(1, 10)]
        rest.append(_line(10, 0, [1], 0, 9.0, n_accepted=0, round_ms=10.0))
        return [first, *rest]

    cold = generation(0, 180.0, [[52.5, 47.5, 3]])
    warm = generation(512, 12.0, None)  # a log from before the `copies` field
    rows = summary.generations(summary.rounds_of(cold + warm))
    assert [(r["cached"], r["first_ms"], r["copies_ms"]) for r in rows] == [
        (0, 180.0, 100.0),
        (512, 12.0, None),
    ]
    assert all(r["rounds"] == 10 and r["empty"] == 1 and r["tokens"] == 28 for r in rows)
    assert rows[0]["tokens_per_s"] == 1e3 * 28 / 190.0
    log = tmp_path / "rounds.log"
    log.write_text("\n".join(cold))
    assert summary.main(["--generations", str(log)]) == 0
    out = capsys.readouterr().out
    assert "first round   180.0 ms (copies 100.0)" in out and "28 tokens at  147.4 tok/s" in out
