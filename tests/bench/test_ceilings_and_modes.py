"""Issue 16's harness parts without a server: builtin-synth's argument, llama.cpp's
drafter statistics, oracle delays as plain steps, the ceiling keys of each row, the
Strix Halo prediction, and no import circle inside proxy.bench."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from proxy.bench.costmodel import ideal_ceiling, overlap_ceiling
from proxy.bench.modes import last_draft_stats, synth_rates
from proxy.bench.runner import BenchOptions, mode_specs, mode_units, oracle_delays
from proxy.bench.stats import ROW_KEYS, summary_rows

BENCH = Path(__file__).resolve().parents[2] / "proxy" / "bench"


def test_synth_rates_are_unconditional_powers_of_a() -> None:
    # b11434 common/speculative.cpp: exactly n_max values, each in [0, 1], non-increasing,
    # unconditional; the server accepts position i with P_i / P_(i-1)
    text = synth_rates(0.5, 3)
    assert text == "0.5,0.25,0.125"
    rates = [float(x) for x in synth_rates(0.77, 6).split(",")]
    assert len(rates) == 6
    assert rates == sorted(rates, reverse=True) and all(0 <= r <= 1 for r in rates)
    conditional = [rates[0]] + [rates[i] / rates[i - 1] for i in range(1, 6)]
    assert conditional == pytest.approx([0.77] * 6, rel=1e-5)
    assert synth_rates(1.0, 2) == "1,1"
    with pytest.raises(ValueError):
        synth_rates(1.2, 2)
    with pytest.raises(ValueError):
        synth_rates(0.5, 0)


def test_last_draft_stats_reads_llamacpp_statistics_lines() -> None:
    # the format of common_speculative_print_stats (b11434), logged at -lv 4
    line = (
        "spec common_specu: statistics     draft-simple: #calls(b,g,a) =    2     {g} "
        "    {g}, #gen drafts =     {g}, #acc drafts =     5, #gen tokens =    {t}, "
        "#acc tokens =    12, #mean acc len = 2.20, #acc rate/pos = (0.5, 0.2), "
        "dur(b,g,a) = 0.100, {ms}, 0.400 ms"
    )
    log = "\n".join(
        ["srv  load_model: loading", line.format(g=10, t=30, ms="12.500"), "slot release",
         line.format(g=25, t=75, ms="31.250")]
    )  # fmt: skip
    stats = last_draft_stats(log)
    assert stats is not None
    assert (stats.calls, stats.tokens, stats.ms) == (25, 75, 31.25)
    assert last_draft_stats("no statistics here") is None


def test_builtin_synth_and_oracle_delay_steps_modes() -> None:
    options = BenchOptions(
        target=Path("t.gguf"),
        modes=["plain", "builtin", "builtin-synth", "proxy", "oracle"],
        oracle_acceptance=[0.6, 0.77],
        oracle_delay_steps=[0.12, 0.27],
    )
    delays = oracle_delays(options, plain_ms=10.0)
    assert delays == [(0.12, pytest.approx(1.2)), (0.27, pytest.approx(2.7))]
    specs = mode_specs(options, 4, delays=delays)
    names = [s.name for s in specs]
    assert names == [
        "plain", "builtin", "builtin-synth(a=0.6)", "builtin-synth(a=0.77)", "proxy",
        "oracle(a=0.6,X=0.12,1.2ms)", "oracle(a=0.6,X=0.27,2.7ms)",
        "oracle(a=0.77,X=0.12,1.2ms)", "oracle(a=0.77,X=0.27,2.7ms)",
    ]  # fmt: skip
    synth = specs[2]
    assert synth.k == 4 and not synth.valid_output and not synth.speculative
    assert all(s.valid_output for s in specs if s.kind != "builtin-synth")
    units = mode_units(specs)
    assert units[:4] == specs[:4] and units[4] == specs[4:]  # builtins alone
    with pytest.raises(RuntimeError):
        oracle_delays(options, plain_ms=None)
    fixed = BenchOptions(target=Path("t.gguf"), oracle_delay_ms=11.0)
    assert oracle_delays(fixed, None) == [(None, 11.0)]


def _run(mode: str, kind: str, k: int, stats: dict, **params) -> dict:
    return {"mode": mode, "kind": kind, "k": k, "context": 512, "repeat": 0, "prompt": "p",
            "n_generated": 101, "decode_ms": 1000.0 if kind == "plain" else 500.0,
            "ttft_ms": 5.0, "equal_to_plain": None if kind == "builtin-synth" else True,
            "exact_checked": True, "spec_header": None, "stats": stats,
            "valid_output": kind != "builtin-synth",
            "mode_params": {"acceptance": None, "delay_ms": 0.0, "delay_steps": None,
                            **params}}  # fmt: skip


def test_summary_rows_carry_the_ceiling_keys() -> None:
    builtin_stats = {
        "rounds": 20, "drafted": 80, "accepted": 40, "decodes": 20,
        "drafted_per_position": [20, 20, 20, 20], "accepted_per_position": [16, 12, 8, 4],
        "draft_timer_ms": 160.0, "draft_timer_tokens": 80,
    }  # fmt: skip
    oracle_stats = {
        "rounds": 20, "drafted": 80, "accepted": 40, "decodes": 20,
        "drafted_per_position": [20, 20, 20, 20], "accepted_per_position": [16, 12, 8, 4],
        "steady": {"rounds": 20, "drafted": 80, "draft_ms": 200.0, "verify_ms": 400.0,
                   "overhead_ms": 20.0, "decodes": 20},
    }  # fmt: skip
    proxy_stats = {**oracle_stats, "steady": {**oracle_stats["steady"], "drafted_ahead": 40}}
    runs = [
        _run("proxy", "proxy", 4, proxy_stats),
        _run("plain", "plain", 0, {"rounds": 101, "drafted": 0, "accepted": 0, "decodes": 101}),
        _run("builtin", "builtin", 4, builtin_stats),
        _run("builtin-synth(a=0.8)", "builtin-synth", 4, builtin_stats, acceptance=0.8),
        _run("oracle(a=0.8,X=0.2,2ms)", "oracle", 4, oracle_stats, acceptance=0.8,
             delay_ms=2.0, delay_steps=0.2),
    ]  # fmt: skip
    round_ms = {1: 10.0, 2: 10.5, 4: 12.0, 6: 14.0}
    costs = {"512": {"plain_ms": 10.0, "round_ms": {str(k): v for k, v in round_ms.items()}}}
    rows = {r["kind"]: r for r in summary_rows(runs, [], costs, "qwen3-0.6b")}
    for row in rows.values():
        assert set(ROW_KEYS) <= set(row)
    plain = rows["plain"]
    assert plain["tok_s"] == plain["plain_tok_s"] == 100.0
    assert plain["ideal_tok_s"] is None and plain["draft_shape"] is None
    oracle = rows["oracle"]
    a = oracle["acceptance"]
    assert a == pytest.approx(40 / 56)  # ML estimate: 40 accepted of 20+16+12+8 reached
    assert oracle["draft_ms_per_token"] == 2.0 and oracle["draft_shape"] == "oracle"
    assert oracle["oracle_delay_steps"] == 0.2 and oracle["oracle_delay_ms"] == 2.0
    ideal = ideal_ceiling(a, round_ms)
    overlap = overlap_ceiling(a, round_ms, 2.0, 0.0)
    assert oracle["ideal_tok_s"] == pytest.approx(ideal.tokens_per_s)
    assert oracle["overlap_tok_s"] == pytest.approx(overlap.tokens_per_s)
    assert oracle["meas_over_ideal"] == pytest.approx(200.0 / ideal.tokens_per_s)
    assert oracle["meas_over_overlap"] == pytest.approx(200.0 / overlap.tokens_per_s)
    builtin = rows["builtin"]
    assert builtin["draft_ms_per_token"] == 2.0  # llama.cpp's timer: 160 ms / 80 tokens
    assert builtin["draft_shape"] == "qwen3-0.6b" and builtin["output_valid"]
    proxy = rows["proxy"]  # 200 ms waited for the 80 - 40 drafts not ready from ahead
    assert proxy["draft_ms_per_token"] == 5.0 and proxy["resync_ms"] == 0.0
    assert proxy["overlap_tok_s"] == pytest.approx(overlap_ceiling(a, round_ms, 5.0).tokens_per_s)
    assert proxy["draft_shape"] == "qwen3-0.6b"
    synth = rows["builtin-synth"]
    assert not synth["output_valid"] and synth["summary"]["n_compared"] == 0
    # with the rounds after each number accepted (part h), t_v(k) pays the catch-up at
    # the row's own acceptance: a cliff at k = 2 after 2 accepted moves the ideal to k = 1
    after = {"1": {"0": 10.0, "1": 10.5}, "2": {"0": 10.5, "1": 11.0, "2": 40.0}}
    cliff = {"512": {**costs["512"], "round_ms_after": after}}
    weighted = {1: 10.0 * (1 - a) + 10.5 * a, 2: 10.5 * (1 - a) + 11.0 * a * (1 - a) + 40 * a * a}
    row = {r["kind"]: r for r in summary_rows(runs, [], cliff, "qwen3-0.6b")}["oracle"]
    assert row["ideal_tok_s"] == pytest.approx(ideal_ceiling(a, weighted).tokens_per_s)
    assert row["ideal_k"] == 1 and oracle["ideal_k"] != 1
    # without round costs: no ceilings, and the row says why
    bare = {r["kind"]: r for r in summary_rows(runs, [])}
    assert bare["oracle"]["overlap_tok_s"] is None
    assert bare["oracle"]["overlap_note"] == "no round costs measured"


def test_prediction_is_labelled_and_scales_with_efficiency() -> None:
    from proxy.bench.predict import prediction_lines

    full = prediction_lines(1.0, [0.8])
    half = prediction_lines(0.5, [0.8])
    assert full[0].startswith("PREDICTION")
    row_full = next(line for line in full if line.startswith("| Qwen3-32B | 0.80"))
    row_half = next(line for line in half if line.startswith("| Qwen3-32B | 0.80"))
    overlap = row_full.split("|")[6].split()[0]  # "low-high"
    predicted_full = row_full.split("|")[7].strip()
    assert predicted_full == overlap  # efficiency 1: the overlap ceiling itself
    low_full = float(predicted_full.split("-")[0])
    low_half = float(row_half.split("|")[7].strip().split("-")[0])
    assert low_half == pytest.approx(low_full / 2, abs=0.06)


def _bench_imports(path: Path) -> set[str]:
    """proxy.bench modules this file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.split(".")[2] for n in names if n.startswith("proxy.bench.")}
    return found - {path.stem}


def test_no_import_circle_in_proxy_bench() -> None:
    graph = {p.stem: _bench_imports(p) for p in BENCH.glob("*.py") if p.stem != "__init__"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start]:
            if dep == goal or (dep not in seen and reaches(dep, goal, seen | {dep})):
                return True
        return False

    circles = [m for m in graph if reaches(m, m, {m})]
    assert circles == [], f"import circles through {circles}"


def test_mode_k_runs_a_mode_only_at_its_own_k() -> None:
    import argparse

    from proxy.bench.cli import _mode_k
    from proxy.bench.runner import sweep_ks

    assert _mode_k("proxy=4") == ("proxy", [4])
    for bad in ("proxy", "plain=2", "turbo=2", "proxy="):
        with pytest.raises(argparse.ArgumentTypeError):
            _mode_k(bad)
    options = BenchOptions(
        target=Path("t.gguf"), modes=["plain", "builtin", "proxy", "oracle"], ks=[2, 4, 6],
        mode_ks={"proxy": [4], "oracle": [4, 8]},
    )  # fmt: skip
    assert sweep_ks(options) == [2, 4, 6, 8]
    by_k = {k: [s.name for s in mode_specs(options, k, with_plain=k == 2)] for k in (2, 4, 6, 8)}
    assert by_k[2] == ["plain", "builtin"]
    assert by_k[4] == ["builtin", "proxy", "oracle(a=0.8,0ms)"]
    assert by_k[6] == ["builtin"]
    assert by_k[8] == ["oracle(a=0.8,0ms)"]  # the other modes keep to -k


async def test_a_shared_server_unit_keeps_the_time_budget_and_saves_each_mode(
    tmp_path: Path, llama_server_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy and oracle modes of one k share a server and run as one unit: the
    budget is checked and the result so far written before and after each of them, so
    a session cut short keeps the modes it finished."""
    import json
    import time

    from proxy.bench import runner
    from proxy.bench.modes import ModeSpec

    class FakeServer:
        def __init__(self, *args: object) -> None:
            pass

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(runner, "VerifyServer", FakeServer)
    session = runner.BenchSession(
        BenchOptions(target=tmp_path / "t.gguf", llama_server=llama_server_bin,
                     work_dir=tmp_path / "work")
    )  # fmt: skip
    ran: list[str] = []

    async def run_mode(http, trial, spec, server=None) -> None:
        ran.append(spec.name)
        session.runs.append({"mode": spec.name})
        session._deadline = time.monotonic() - 1  # the budget is spent after the first

    monkeypatch.setattr(session, "_run_mode", run_mode)
    monkeypatch.setattr(session, "result", lambda finished: {"runs": list(session.runs)})
    session._progress = tmp_path / "progress.json"
    session._deadline = time.monotonic() + 60
    unit = [ModeSpec("proxy", 4, variant=v) for v in ("a", "b", "c")]
    trial = runner.Trial(512, 0, [], {}, None, {}, [])  # type: ignore[arg-type]
    await session._run_unit(None, trial, unit)  # type: ignore[arg-type]
    assert ran == [unit[0].name]
    assert [e["mode"] for e in session.errors] == [unit[1].name, unit[2].name]
    saved = json.loads(session._progress.read_text())
    assert [r["mode"] for r in saved["runs"]] == [unit[0].name]


@pytest.mark.parametrize(
    ("turns", "context", "priced"), [(1, 512, 512), (3, 512, 900), (1, None, 900)]
)
async def test_the_ceiling_is_priced_at_the_turns_context(
    tmp_path: Path, llama_server_bin: Path, monkeypatch: pytest.MonkeyPatch,
    turns: int, context: int | None, priced: int,
) -> None:  # fmt: skip
    """A chat's later turns run at 2-3 times the first turn's context, where a round
    reads more KV: its round costs are measured at the median turn's prompt, a single
    turn's at the context asked for."""
    from proxy.bench import runner
    from proxy.bench.prompts import BenchPrompt

    measured: list[int] = []

    async def measure(target: Path, length: int, ks: object, **kwargs: object) -> object:
        measured.append(length)
        return runner.RoundCosts(length, 40.0, {}, {}, {})

    monkeypatch.setattr(runner, "measure_round_costs", measure)
    session = runner.BenchSession(
        BenchOptions(target=tmp_path / "t.gguf", llama_server=llama_server_bin,
                     work_dir=tmp_path / "work", turns=turns)
    )  # fmt: skip
    prompts = [BenchPrompt(f"p/t{n}", "chat", (1,) * n) for n in (513, 900, 1300)]
    await session._cost_phase(context, prompts)
    assert measured == [priced]
