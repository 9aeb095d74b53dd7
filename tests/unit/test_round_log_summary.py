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


def test_fill_sets_cold_and_warm_generations_on_the_path_against_plain(tmp_path, capsys):
    summary = load_script("round_log_summary")

    def generation(cached: int, fill_ms: float, empty: int) -> list[str]:
        """A first round of a 40 ms request and `fill_ms` beyond it, then 10 rounds of
        3 tokens in 20 ms, of which `empty` commit one token without a draft."""
        first = _line(0, 0, [513 - cached], 0, 40.0, n_accepted=0, n_context=513,
                      draft_ms=0.0, verify_ms=40.0, round_ms=40.0 + fill_ms)  # fmt: skip
        first = first.replace("500, 40.0]", f"{cached}, 40.0]")
        rest = [
            _line(i, 0 if i <= empty else 2, [1, 2, 3], 0, 15.0,
                  n_accepted=0 if i <= empty else 2, round_ms=20.0)
            for i in range(1, 11)
        ]  # fmt: skip
        return [first, *rest]

    log = tmp_path / "rounds.log"
    log.write_text("\n".join([
        *generation(0, 500.0, 0),  # the warm-up: left out
        *generation(0, 100.0, 0), *generation(4, 60.0, 2),
        *generation(0, 80.0, 5),  # off the oracle's path: left out
        *generation(512, 1.0, 0),
    ]))  # fmt: skip
    rows = summary.generations(summary.rounds_of(log.read_text().splitlines()))[1:]
    # at 10 ms a token plain: 30 tokens in 200 ms is 1.5x, 26 (2 empty rounds) 1.3x
    sides = summary.fill_sides(rows, 10.0)
    assert set(sides) == {"cold", "warm"}
    cold = sides["cold"]
    assert cold["fill_ms"] == [100.0, 60.0]
    assert cold["rounds_x"] == [1.5, 1.3]
    assert cold["with_fill_x"] == [300 / 300, 260 / 260]
    assert cold["slack_ms"] == [100.0, 60.0] and cold["median_slack_ms"] == 80.0
    assert sides["warm"]["with_fill_x"] == [300 / 201]
    assert summary.main(["--fill", "10", str(log)]) == 0
    out = capsys.readouterr().out
    assert "cold: 2 generations, fill ms [100, 60]; rounds after the first 1.40x plain" in out
    assert "with the fill 1.00x" in out
    assert "a cold generation matches plain with a fill of up to 80 ms (median)" in out
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"round_costs": {"512": {"context": 512, "plain_ms": 10.0}}}))
    assert summary.main(["--fill", str(result), str(log)]) == 0
    assert "up to 80 ms (median)" in capsys.readouterr().out


def _run(tokens: int, run_ms: float, server_ms: float, beside: str | None) -> str:
    record = {"i": 1, "n_run_tokens": tokens, "n_context": 600, "cached": 599,
              "run_ms": run_ms, "server_ms": server_ms, "overhead_ms": 1.0,
              "server_idle_ms": 2.0, "slot": 0, "beside": beside,
              "drafter_busy": False}  # fmt: skip
    return "2026-12-08 00:00:00,000 DEBUG proxy.engine.rounds.log: run " + json.dumps(record)


def test_plain_runs_are_set_per_token_by_what_the_drafter_did_beside_them():
    summary = load_script("round_log_summary")
    lines = [
        _line(0, 0, [513], 0, 40.0),  # a round: not a run
        _run(16, 192.0, 180.0, "timing"),
        _run(16, 184.0, 176.0, None),
        _run(8, 96.0, 88.0, None),
        _run(16, 176.0, 168.0, None),
    ]
    assert [r["n_drafted"] for r in summary.rounds_of(lines)] == [0]
    rows = summary.run_summary(summary.runs_of(lines))
    assert rows == [
        {"beside": "nothing", "runs": 3, "tokens": 40, "wall_ms_per_token": 11.5,
         "server_ms_per_token": 11.0, "overhead_ms": 1.0, "server_idle_ms": 2.0},
        {"beside": "timing", "runs": 1, "tokens": 16, "wall_ms_per_token": 12.0,
         "server_ms_per_token": 11.25, "overhead_ms": 1.0, "server_idle_ms": 2.0},
    ]  # fmt: skip
