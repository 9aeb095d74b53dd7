"""The human-readable table of a bench result."""

from __future__ import annotations

import statistics
from typing import Any

COLUMNS = [
    ("ctx", 6), ("k", 2), ("mode", 22), ("tok/s [min-max]", 20), ("x plain", 7),
    ("ideal (k)", 10), ("overlap (k)", 11), ("meas/ideal", 10), ("meas/overlap", 12),
    ("t_d ms", 6),
    ("TTFT ms", 8), ("t32 ms", 6), ("plain run", 9), ("accept", 6), ("acc/rnd", 7),
    ("k/rnd", 5), ("empty", 5), ("ru", 3),
    ("a iid", 5),
    ("accept by position", 24),
    ("draft/verify/ovh ms", 20), ("srv ms", 6), ("tok in", 6), ("dec/rnd", 7),
    ("pred turns|ovl", 15), ("meas/pred", 9),
    ("RSS MB srv+proxy", 16), ("GPU MB", 7), ("=plain", 7),
]  # fmt: skip


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(entry: dict[str, Any]) -> list[str]:
    s = entry["summary"]
    speed = (
        f"{_f(s['tokens_per_s_median'])} [{_f(s['tokens_per_s_min'])}-{_f(s['tokens_per_s_max'])}]"
    )
    positions = " ".join(
        "-" if a is None else f"{a:.2f}".lstrip("0") for a in s.get("acceptance_per_position", [])
    )
    split = "-"
    if "verify_ms_per_round" in s:
        split = "/".join(
            _f(s[key])
            for key in ("draft_ms_per_round", "verify_ms_per_round", "overhead_ms_per_round")
        )
    predicted = s.get("predicted")
    pred = (
        f"{_f(predicted['tokens_per_s_turns'])}|{_f(predicted['tokens_per_s_overlapped'])}"
        if predicted
        else "-"
    )
    memory = s.get("memory", {})
    rss = _f(memory.get("rss_mb.llama-server"), 0)
    if "rss_mb.proxy" in memory:
        rss += f"+{_f(memory['rss_mb.proxy'], 0)}"
    per_process = sum(
        v
        for name, v in memory.items()
        if name.startswith("gpu_mb.") and name != "gpu_mb.device_used"
    )
    gpu = per_process or memory.get("gpu_mb.device_used")  # pids unseen inside a container
    return [
        "natural" if entry["context"] is None else str(entry["context"]),
        str(entry["k"]),
        entry["mode"],
        speed,
        _f(entry.get("speedup_vs_plain"), 2),
        _ceiling(entry.get("ideal_tok_s"), entry.get("ideal_k")),
        _ceiling(entry.get("overlap_tok_s"), entry.get("overlap_k")),
        _f(entry.get("meas_over_ideal"), 2),
        _f(entry.get("meas_over_overlap"), 2),
        _f(entry.get("draft_ms_per_token"), 2),
        _f(s["ttft_ms_median"], 0),
        _f(s.get("first_n_ms_median"), 0),
        "-" if s.get("plain_run_share") is None else f"{100 * s['plain_run_share']:.0f}%",
        _f(s.get("acceptance"), 2),
        _f(s.get("accepted_per_round"), 2),
        _f(s.get("drafted_per_round"), 2),
        "-" if s.get("empty_draft_rounds") is None else str(s["empty_draft_rounds"]),
        "-" if s.get("runner_up_line_rounds") is None else str(s["runner_up_line_rounds"]),
        _f(s.get("acceptance_iid"), 2),
        positions or "-",
        split,
        _f(s.get("server_ms_per_round")),
        _f(s.get("verify_prompt_tokens_per_round")),
        _f(s.get("decodes_per_round"), 2),
        pred,
        _f(s.get("measured_over_predicted"), 2),
        rss,
        _f(gpu, 0),
        _equality(s),
    ]


def _ceiling(value: float | None, k: int | None) -> str:
    return "-" if value is None else f"{value:.1f} ({k})"


def _equality(s: dict[str, Any]) -> str:
    if s.get("n_compared", s["n_runs"]) == 0 and s["n_runs"]:
        return "not valid"  # builtin-synth: benchmarking only
    return f"{s['n_equal_to_plain']}/{s['n_runs']}" + (
        f" +{s['n_near_tie']} tie" if s.get("n_near_tie") else ""
    )


# an oracle run with more of its rounds than this share without a draft (and more than
# 2) left its recorded path; one that stayed on it has a few, where a near-tie branch
# ended before the reference did
OFF_PATH_SHARE = 0.2


def on_oracle_path(empty_rounds: int, rounds: int) -> bool:
    """Whether an oracle run (or one generation of it) with `empty_rounds` of its
    `rounds` without a draft stayed on the oracle's recorded path."""
    return empty_rounds <= max(2, OFF_PATH_SHARE * rounds)


def on_path_lines(result: dict[str, Any]) -> list[str]:
    """The oracle rows again, from their runs on the oracle's recorded path only: a
    run whose output flips a second near-tie has no drafts for the rest of it, and two
    variants that flip at different places compare different amounts of drafting
    (docs/BENCHMARKS.md, "Padding decided on the GPU"). Each run is set against plain's
    median on the same context and prompt. No lines where every oracle run stayed on."""
    runs = result.get("runs", [])
    plain: dict[tuple[Any, str], list[float]] = {}
    for run in runs:
        if run["kind"] == "plain" and run.get("tokens_per_s"):
            plain.setdefault((run["context"], run["prompt"]), []).append(run["tokens_per_s"])
    rows: dict[tuple[Any, int, str], list[float | None]] = {}
    for run in runs:
        if run["kind"] != "oracle":
            continue
        stats = run.get("stats") or {}
        on_path = on_oracle_path(stats.get("empty_draft_rounds") or 0, stats.get("rounds") or 0)
        base = plain.get((run["context"], run["prompt"]))
        ratio = None
        if on_path and base and run.get("tokens_per_s"):
            ratio = run["tokens_per_s"] / statistics.median(base)
        rows.setdefault((run["context"], run["k"], run["mode"]), []).append(ratio)
    if all(r is not None for ratios in rows.values() for r in ratios):
        return []
    lines = [
        f"on the oracle's path (at most {OFF_PATH_SHARE:.0%} of a run's rounds without a draft):"
    ]
    for (context, k, mode), ratios in rows.items():
        kept = [r for r in ratios if r is not None]
        median = f"{statistics.median(kept):.2f}x plain" if kept else "-"
        lines.append(f"  {context} k={k} {mode}: {len(kept)}/{len(ratios)} runs, median {median}")
    return lines


def render_table(result: dict[str, Any]) -> str:
    rows = [[name for name, _ in COLUMNS]] + [_row(e) for e in result["summary"]]
    widths = [max(width, *(len(r[i]) for r in rows)) for i, (_, width) in enumerate(COLUMNS)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [
        "tok/s: decode speed (tokens-1)/(last-first token), median over repeats [min-max].",
        "ideal (k): max over k of E(k)/t_v(k) at the row's a iid, E(k) = (1-a^(k+1))/(1-a), "
        "t_v(k) = the k+1-prompt round measured on a managed-mode server at this context "
        "(result round_costs), after each number j of the last round's drafts accepted and "
        "weighted by the row's chance of j (each slot catches up on what it lacks): a free "
        "draft, the stock API's limit. overlap (k): max over k "
        "of E(k)/T(k), T(k) = t_v(k) + (1-a^(k+1))(t_resync + k t_d): drafting ahead along "
        "the all-accepted line. t_d: proxy = draft ms per drafted token from its /metrics "
        "(re-sync included, t_resync = 0); oracle = its delay; builtin = llama.cpp's draft() "
        "timer per token from its log (its pass over the verified batch is untimed, "
        "t_resync = 0). Both describe speculative rounds: where plain runs made part of the "
        "output, meas/ideal can pass 1 (and a row decoded mostly in plain runs has no a).",
        "builtin-synth(a): llama-server --spec-synth-rates a,a^2,..,a^k with the real draft: "
        "BENCHMARKING ONLY: OUTPUT NOT VALID (not compared with plain: =plain 'not valid'). "
        "oracle(a,X,ms): X = --oracle-delay-steps, the delay per token as a fraction of the "
        "plain step measured at this context, and that delay in ms.",
        "TTFT ms, t32 ms: request start to the first and to the 32nd streamed token, median "
        "(a cold request's slot fill after its first token shows in t32).",
        "accept = accepted/drafted; acc/rnd = accepted per round; a iid = the per-token "
        "acceptance the cost model uses (ML estimate from per-position counts).",
        "pred turns|ovl: cost model (proxy/bench/costmodel.py) from a iid, k/rnd and the measured "
        "draft/verify/overhead ms; meas/pred: all runs pooled over taking turns.",
        "=plain: runs equal to plain llama-server (exact ids where checked, else streamed "
        "ids and text); +N tie: differing runs whose first difference the server's top-2 "
        "logits show to be a near-tie (gap < 0.02); dec/rnd: llama_decode calls per round "
        "(plain: per token); k/rnd: drafts per round (adaptive k chooses up to k); empty: "
        "rounds without a draft (the oracle: rounds off every recorded path, its reference "
        "continuations and their near-tie branches); ru: rounds after a miss whose draft "
        "came ready from the line drafted after the runner-up (--runner-up-lines); plain run: "
        "share of the output llama-server decoded alone (the per-round columns and the cost "
        "model describe the speculative rounds only, so no meas/pred is given with plain runs).",
    ]
    path = on_path_lines(result)
    return "\n".join([*lines, *(["", *path] if path else []), "", *notes])
