"""From counters and timings to the numbers the table shows.

Per request (`request_stats`): rounds, drafted, accepted, per-position counts, the
per-round millisecond split and server decodes, read from `/metrics` deltas:

- proxy/oracle: the proxy's `npu_spec_*` counters (`empty_draft_rounds`: rounds the
  drafter proposed nothing for; the oracle's rounds off every recorded path); millisecond
  sums and decodes
  come from the steady window (first token -> end) so the first round, which also
  prefills the prompt into k+1 slots, does not count as a verify cost.
- builtin: llama-server's `spec_decode_*` counters, which it adds up when the
  request ends (whole request); drafted per position is taken as one per round
  for each of the k positions (llama.cpp does not count it).
- plain: one round per generated token; decodes over the whole request.

- builtin-synth: as builtin. Both also carry llama.cpp's own drafter timer
  (`draft_timer_ms`, `draft_timer_tokens`: time inside its draft() calls, from the
  server log, see proxy.bench.modes.last_draft_stats).

Per mode (`summarize`): medians and spread over repeats, pooled acceptance, and
the cost-model prediction. Per row (`summary_rows`): the ceilings of
proxy.bench.costmodel from the session's measured round costs (`ceiling_keys`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from proxy.bench.costmodel import (
    acceptance_from_positions,
    expected_round_ms,
    ideal_ceiling,
    overlap_ceiling,
    predict,
)
from proxy.bench.modes import BUILTIN_KINDS, MODE_KINDS
from proxy.bench.prom import delta, per_position

DECODES = "llamacpp:n_decode_total"
SPECULATIVE_KINDS = ("proxy", "oracle")  # served through the proxy
KIND_ORDER = {kind: i for i, kind in enumerate(MODE_KINDS)}
# the flat keys every summary row carries (issue 16), besides `summary`
ROW_KEYS = (
    "mode", "context", "k", "tok_s", "plain_tok_s", "ideal_tok_s", "overlap_tok_s",
    "acceptance", "draft_ms_per_token", "draft_shape", "resync_ms", "ideal_k", "overlap_k",
    "meas_over_ideal", "meas_over_overlap", "oracle_delay_steps", "oracle_delay_ms",
    "output_valid", "overlap_note",
)  # fmt: skip


def _proxy_counters(d: dict[str, float]) -> dict[str, Any]:
    return {
        "rounds": round(d.get("npu_spec_rounds_total", 0)),
        # rounds the drafter proposed nothing for (the oracle: off every recorded path)
        "empty_draft_rounds": round(d.get("npu_spec_empty_draft_rounds_total", 0)),
        "drafted": round(d.get("npu_spec_draft_tokens_total", 0)),
        # rounds after a miss whose draft a runner-up line held (--runner-up-lines)
        "runner_up_line_rounds": round(d.get("npu_spec_runner_up_line_rounds_total", 0)),
        "accepted": round(d.get("npu_spec_accepted_tokens_total", 0)),
        "drafted_ahead": round(d.get("npu_spec_ahead_tokens_total", 0)),
        "drafted_per_position": per_position(d, "npu_spec_draft_tokens_per_position_total"),
        "accepted_per_position": per_position(d, "npu_spec_accepted_tokens_per_position_total"),
        "draft_ms": d.get("npu_spec_draft_ms_sum", 0.0),
        "verify_ms": d.get("npu_spec_verify_ms_sum", 0.0),
        "overhead_ms": d.get("npu_spec_overhead_ms_sum", 0.0),
        "server_ms": d.get("npu_spec_server_ms_sum", 0.0),
        "prompt_tokens": round(d.get("npu_spec_verify_prompt_tokens_total", 0)),
        # verify rounds only: a plain run decodes once per token it generates
        "decodes": round(d.get(DECODES, 0) - d.get("npu_spec_plain_run_tokens_total", 0)),
        "plain_run_tokens": round(d.get("npu_spec_plain_run_tokens_total", 0)),
        # requests that fell back to plain decoding: a broken drafter must not pass
        # for a slow one
        "drafter_failures": round(d.get("npu_spec_drafter_failures_total", 0)),
    }


def request_stats(
    kind: str, k: int, n_generated: int, before: dict, first: dict, after: dict
) -> dict[str, Any]:
    whole = delta(after, before)
    if kind in ("proxy", "oracle"):
        out = _proxy_counters(whole)
        steady = _proxy_counters(delta(after, first)) if first else out
        out["steady"] = {
            name: steady[name]
            for name in (
                "rounds",
                "empty_draft_rounds",
                "drafted",
                "drafted_ahead",
                "draft_ms",
                "verify_ms",
                "overhead_ms",
                "server_ms",
                "prompt_tokens",
                "decodes",
            )
        }
        return out
    if kind in BUILTIN_KINDS:
        rounds = round(whole.get("llamacpp:spec_decode_num_drafts_total", 0))
        accepted_pos = per_position(whole, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total")
        return {
            "rounds": rounds,
            "drafted": round(whole.get("llamacpp:spec_decode_num_draft_tokens_total", 0)),
            "accepted": round(whole.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)),
            "drafted_per_position": [rounds] * max(k, len(accepted_pos)),
            "accepted_per_position": accepted_pos,
            "decodes": round(whole.get(DECODES, 0)),
        }
    return {
        "rounds": n_generated,
        "drafted": 0,
        "accepted": 0,
        "decodes": round(whole.get(DECODES, 0)),
    }


def _sum_lists(lists: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        for i, value in enumerate(values):
            if i >= len(total):
                total.append(0)
            total[i] += value
    return total


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _pooled_speed(runs: list[dict[str, Any]]) -> float | None:
    """Decode tokens/s over several requests (token-weighted)."""
    tokens = sum(max(r["n_generated"] - 1, 0) for r in runs)
    seconds = sum(r["decode_ms"] for r in runs) / 1e3
    return tokens / seconds if seconds > 0 else None


def repeat_speeds(runs: list[dict[str, Any]]) -> list[float]:
    """Decode tokens/s of each repeat, pooled over its prompts."""
    by_repeat: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_repeat.setdefault(run["repeat"], []).append(run)
    speeds = [_pooled_speed(group) for group in by_repeat.values()]
    return [speed for speed in speeds if speed is not None]


def summarize(
    kind: str, k: int, runs: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> dict[str, Any]:
    """One table row: everything measured for one (mode, k, context)."""
    out = {**_speeds(runs), **_run_counts(runs), **_round_counts(kind, runs)}
    if kind != "plain":
        out.update(_acceptance_by_position(runs))
    steady = _steady_totals(runs)
    out.update(_round_costs(steady, runs, out["rounds"]))
    if kind in BUILTIN_KINDS:  # llama.cpp's own drafter timer, where its log had one
        timed = [r["stats"] for r in runs if "draft_timer_ms" in r["stats"]]
        out["draft_ms_per_token"] = _ratio(
            sum(t["draft_timer_ms"] for t in timed), sum(t["draft_timer_tokens"] for t in timed)
        )
    a = out.get("acceptance_iid")
    if kind in SPECULATIVE_KINDS and a is not None and steady["rounds"]:
        out.update(_prediction(out, a, k, steady))
    out["memory"] = _peak_memory(memory)
    return out


def _speeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    speeds = repeat_speeds(runs)
    first_n = [r["first_n_ms"] for r in runs if r.get("first_n_ms") is not None]
    return {
        "tokens_per_s_median": statistics.median(speeds) if speeds else None,
        "tokens_per_s_min": min(speeds) if speeds else None,
        "tokens_per_s_max": max(speeds) if speeds else None,
        "tokens_per_s_repeats": speeds,
        "tokens_per_s_pooled": _pooled_speed(runs),
        "ttft_ms_median": statistics.median(r["ttft_ms"] for r in runs) if runs else None,
        "first_n_ms_median": statistics.median(first_n) if first_n else None,
    }


def _run_counts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "n_runs": len(runs),
        "n_equal_to_plain": sum(1 for r in runs if r["equal_to_plain"]),
        # builtin-synth: benchmarking only, its output is not compared
        "n_compared": sum(1 for r in runs if r["equal_to_plain"] is not None),
        # differing runs whose first difference the server shows to be a near-tie
        "n_near_tie": sum(1 for r in runs if (r.get("near_tie") or {}).get("near_tie")),
        "n_exact_checked": sum(1 for r in runs if r.get("exact_checked")),
        "n_speculative": sum(1 for r in runs if r.get("spec_header") == "speculative"),
        "drafter_failures": sum(r["stats"].get("drafter_failures", 0) for r in runs),
    }


def _round_counts(kind: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = sum(r["stats"]["rounds"] for r in runs)
    drafted = sum(r["stats"]["drafted"] for r in runs)
    accepted = sum(r["stats"]["accepted"] for r in runs)
    generated = sum(r["n_generated"] for r in runs)
    speculative = kind in SPECULATIVE_KINDS

    def per_round(stat: str) -> float | None:
        return _ratio(sum(r["stats"].get(stat, 0) for r in runs), rounds) if speculative else None

    return {
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": _ratio(accepted, drafted),
        "accepted_per_round": _ratio(accepted, rounds) if kind != "plain" else None,
        "drafted_per_round": _ratio(drafted, rounds) if kind != "plain" else None,
        "tokens_per_round": _ratio(generated, rounds),
        # verify rounds without a draft: for the oracle, rounds off every recorded path
        "empty_draft_rounds": sum(r["stats"].get("empty_draft_rounds", 0) for r in runs)
        if speculative
        else None,
        # rounds after a miss whose draft a runner-up line held (--runner-up-lines)
        "runner_up_line_rounds": sum(r["stats"].get("runner_up_line_rounds", 0) for r in runs)
        if speculative
        else None,
        # share of the output the server decoded alone (proxy.plain_runs)
        "plain_run_share": _ratio(
            sum(r["stats"].get("plain_run_tokens", 0) for r in runs), generated
        )
        if speculative
        else None,
    }


def _acceptance_by_position(runs: list[dict[str, Any]]) -> dict[str, Any]:
    drafted_pos = _sum_lists(r["stats"].get("drafted_per_position", []) for r in runs)
    accepted_pos = _sum_lists(r["stats"].get("accepted_per_position", []) for r in runs)
    return {
        "acceptance_per_position": [
            _ratio(accepted_pos[i] if i < len(accepted_pos) else 0, n)
            for i, n in enumerate(drafted_pos)
        ],
        "acceptance_iid": acceptance_from_positions(drafted_pos, accepted_pos),
    }


def _steady_totals(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The steady windows' sums over all runs (proxy and oracle runs have them);
    only `rounds` where they hold no round."""
    steady = [r["stats"]["steady"] for r in runs if "steady" in r["stats"]]
    totals = {"rounds": sum(s["rounds"] for s in steady)}
    if totals["rounds"]:
        for key in ("drafted", "draft_ms", "verify_ms", "overhead_ms", "decodes"):
            totals[key] = sum(s[key] for s in steady)
        for key in ("server_ms", "prompt_tokens"):  # absent from older result files
            totals[key] = sum(s.get(key, 0) for s in steady)
        totals["drafted_ahead"] = sum(s.get("drafted_ahead", 0) for s in steady)
    return totals


def _round_costs(
    steady: dict[str, float], runs: list[dict[str, Any]], rounds: int
) -> dict[str, Any]:
    """Milliseconds and decodes per round: the steady rounds' where there are any."""
    n = steady["rounds"]
    if not n:
        return {"decodes_per_round": _ratio(sum(r["stats"]["decodes"] for r in runs), rounds)}
    return {
        "draft_ms_per_round": steady["draft_ms"] / n,
        "verify_ms_per_round": steady["verify_ms"] / n,
        "overhead_ms_per_round": steady["overhead_ms"] / n,
        # inside verify_ms_per_round: llama-server's own time, and the tokens it ingested
        "server_ms_per_round": steady["server_ms"] / n,
        "verify_prompt_tokens_per_round": steady["prompt_tokens"] / n,
        "draft_ms_per_token": _ratio(steady["draft_ms"], steady["drafted"]),
        # per token drafted while the round waited: drafts that were ready from drafting
        # ahead cost the round (almost) nothing, so they would dilute the drafter's cost
        "draft_ms_per_fresh_token": _ratio(
            steady["draft_ms"], steady["drafted"] - steady["drafted_ahead"]
        ),
        "decodes_per_round": steady["decodes"] / n,
    }


def _prediction(out: dict[str, Any], a: float, k: int, steady: dict[str, float]) -> dict[str, Any]:
    """The cost model's prediction from the row's own measurements, and how the
    measured speed compares."""
    # the draft length the rounds really had: adaptive k drafts fewer than k
    k_drafted = min(float(k), steady["drafted"] / steady["rounds"])
    prediction = predict(
        a, k_drafted, out["draft_ms_per_token"] or 0.0, out["verify_ms_per_round"],
        out["overhead_ms_per_round"],
    )  # fmt: skip
    # pooled over the same runs the prediction's inputs come from
    measured = out["tokens_per_s_pooled"]
    return {
        "predicted": prediction.to_dict(),
        # the model describes speculative rounds only: with plain runs in the output
        # the measured speed is a mixture, so no ratio
        "measured_over_predicted": None
        if out["plain_run_share"]
        else _ratio(measured or 0.0, prediction.tokens_per_s_turns),
    }


def _peak_memory(samples: list[dict[str, Any]]) -> dict[str, float]:
    peak: dict[str, float] = {}
    for sample in samples:
        for name, value in sample.items():
            if value is not None:
                peak[name] = max(peak.get(name, 0.0), float(value))
    return peak


def _draft_cost(
    kind: str, summary: dict[str, Any], params: dict[str, Any]
) -> tuple[float | None, float, str | None]:
    """(t_d, t_resync, why overlap is left out) of a row's drafter.

    proxy: the proxy's /metrics, in the steady rounds: the ms the rounds waited for the
    drafter per token drafted while waiting (drafts ready from drafting ahead left
    out), its re-sync included (the proxy does not time re-sync apart: t_resync = 0).
    oracle: its delay per token, no re-sync cost.
    builtin: llama.cpp's draft() timer per drafted token; the draft model's pass over
    each verified batch is not timed by llama.cpp, so t_resync = 0 (a lower bound)."""
    if kind == "oracle":
        return float(params.get("delay_ms") or 0.0), 0.0, None
    t_d = summary.get("draft_ms_per_fresh_token" if kind == "proxy" else "draft_ms_per_token")
    if kind in SPECULATIVE_KINDS or kind in BUILTIN_KINDS:
        if t_d is None:
            why = "no drafter timer in the server log" if kind in BUILTIN_KINDS else "no rounds"
            return None, 0.0, why
        return t_d, 0.0, None
    return None, 0.0, "plain"


def ceiling_keys(
    entry: dict[str, Any], runs: list[dict[str, Any]], round_ms: dict[int, float],
    plain_tok_s: float | None, draft_shape: str,
    round_ms_after: dict[int, dict[int, float]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The flat ROW_KEYS of one summary row: its speed, and the ideal and overlap
    ceilings at its own measured acceptance over the session's t_v(k): where the
    rounds after each number accepted were measured (`round_ms_after`, verify-cost
    part h), t_v(k) is their mean weighted by that acceptance, so the ceiling pays the
    catch-up a real k-draft round carries; else the round after k // 2 accepted."""
    kind, summary = entry["kind"], entry["summary"]
    params = (runs[0].get("mode_params") or {}) if runs else {}
    a = summary.get("acceptance_iid") if kind != "plain" else None
    tok_s = summary["tokens_per_s_median"]
    t_d, resync, note = _draft_cost(kind, summary, params)
    if a is not None and round_ms_after:  # the catch-up after each j, at this row's a
        weighted = {k: expected_round_ms(a, by_j) for k, by_j in round_ms_after.items()}
        round_ms = {k: ms for k, ms in weighted.items() if ms} or round_ms
    ideal = ideal_ceiling(a, round_ms) if a is not None else None
    overlap = (
        overlap_ceiling(a, round_ms, t_d, resync) if a is not None and t_d is not None else None
    )
    if not round_ms:
        note = "no round costs measured"
    shape = None
    if kind in BUILTIN_KINDS or kind == "proxy":
        shape = draft_shape
    elif kind == "oracle":
        shape = "oracle"
    row = {
        "mode": entry["mode"], "context": entry["context"], "k": entry["k"], "tok_s": tok_s,
        "plain_tok_s": plain_tok_s,
        "ideal_tok_s": ideal.tokens_per_s if ideal else None,
        "overlap_tok_s": overlap.tokens_per_s if overlap else None,
        "acceptance": a, "draft_ms_per_token": t_d, "draft_shape": shape,
        "resync_ms": resync if t_d is not None else None,
        "ideal_k": ideal.k if ideal else None, "overlap_k": overlap.k if overlap else None,
        "meas_over_ideal": _ratio(tok_s, ideal.tokens_per_s) if ideal and tok_s else None,
        "meas_over_overlap": (
            _ratio(tok_s, overlap.tokens_per_s) if overlap and tok_s else None
        ),
        "oracle_delay_steps": params.get("delay_steps") if kind == "oracle" else None,
        "oracle_delay_ms": params.get("delay_ms") if kind == "oracle" else None,
        "output_valid": all(r.get("valid_output", True) for r in runs),
        "overlap_note": None if overlap else note,
    }  # fmt: skip
    return row


def _round_ms(round_costs: dict[str, Any] | None, context: int | None) -> dict[int, float]:
    costs = (round_costs or {}).get(str(context)) or {}
    return {int(k): float(ms) for k, ms in (costs.get("round_ms") or {}).items() if ms}


def _round_ms_after(
    round_costs: dict[str, Any] | None, context: int | None
) -> dict[int, dict[int, float]]:
    costs = (round_costs or {}).get(str(context)) or {}
    return {
        int(k): {int(j): float(ms) for j, ms in by_j.items() if ms}
        for k, by_j in (costs.get("round_ms_after") or {}).items()
    }


def summary_rows(
    runs: list[dict[str, Any]], instances: list[dict[str, Any]],
    round_costs: dict[str, Any] | None = None, draft_shape: str = "core",
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (context, k, mode), with its speed-up over plain at that context
    and the ceiling keys (ROW_KEYS) from `round_costs` (the result's, by context)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["context"], run["k"], run["mode"], run["kind"]), []).append(run)
    # plain has k = 0: one row per context
    entries = []
    for (context, k, mode, kind), group in groups.items():
        memory = [
            i["memory"] for i in instances
            if (i["context"], i["k"], i["mode"]) == (context, k, mode)
        ]  # fmt: skip
        entries.append(
            {"context": context, "k": k, "mode": mode, "kind": kind,
             "summary": summarize(kind, k, group, memory)}
        )  # fmt: skip
    for entry in entries:
        plain = [e for e in entries if e["kind"] == "plain" and e["context"] == entry["context"]]
        base = plain[0]["summary"]["tokens_per_s_median"] if plain else None
        mine = entry["summary"]["tokens_per_s_median"]
        entry["speedup_vs_plain"] = mine / base if base and mine else None
        group = groups[(entry["context"], entry["k"], entry["mode"], entry["kind"])]
        context = entry["context"]
        rounds, after = _round_ms(round_costs, context), _round_ms_after(round_costs, context)
        entry.update(ceiling_keys(entry, group, rounds, base, draft_shape, after))
    entries.sort(key=lambda e: (e["context"] or 0, e["k"], KIND_ORDER[e["kind"]], e["mode"]))
    return entries
