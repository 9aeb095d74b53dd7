"""`npu-spec bench --predict`: the cost model applied to the seed's Strix Halo numbers.

A PREDICTION on paper, not a measurement. Inputs (the seed document "The NPU
drafts, the GPU checks", Unsloth UD-Q4_K_XL on Strix Halo, llama.cpp Vulkan):

- plain decoding: Qwen3-32B 10.4-11.0 tok/s, Qwen3-14B 22.5-24.1 tok/s;
- the NPU drafts with Qwen3-0.6B at 91 tok/s: t_d = 11 ms per token;
- a batch of up to 8 tokens costs about one plain step in Vulkan's matrix-vector
  path, so t_v(k) = one step for k <= 7; a 9-token batch collapsed (k = 8: 12.9 tok/s),
  so k = 8 is left out;
- the seed's own NPU runs took turns (draft, then check); their accepted/drafted
  ratios give the i.i.d. acceptance a (costmodel.acceptance_from_ratio);
- the seed's builtin (0.6B drafting on the GPU): 24.9 tok/s (32B), 43.5 tok/s (14B).

Per target it prints the ideal ceiling (free draft), the overlap ceiling (drafting
ahead along the all-accepted line, t_resync = one drafter step for the correction
token), and the predicted proxy = engine efficiency x overlap, where the engine
efficiency is the proxy's measured meas/overlap (from a bench result, or a flag).
The taking-turns model is checked against the seed's measured NPU rows first.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from proxy.bench.costmodel import (
    acceptance_from_ratio,
    expected_tokens_per_round,
    ideal_ceiling,
    multi_outcome_ceiling,
    overlap_ceiling,
)

NPU_DRAFT_MS = 1e3 / 91  # Qwen3-0.6B on the XDNA 2 NPU: 91 tok/s
MAX_K_ONE_STEP = 7  # k + 1 <= 8 tokens cost one step; 9 collapsed
# Drafting several likely outcomes at once (costmodel.multi_outcome_round_ms): lines
# per batch, the share of rejections whose correction is the draft's runner-up (not
# measured for Qwen3-0.6B against Qwen3-32B: a range), and what a batch of that many
# sequences costs the NPU over one (assumed: matrix-vector bound, like the GPU's).
OUTCOME_LINES = 3
RUNNER_UP_HITS = (0.3, 0.5)
NPU_BATCH_COST = (1.0, 1.5)


@dataclass(frozen=True)
class SeedTarget:
    name: str
    plain_tok_s: tuple[float, float]  # low, high
    builtin_tok_s: float  # 0.6B drafting on the GPU (llama.cpp)
    npu_rows: tuple[tuple[int, float, float, float], ...]  # k, plain, NPU tok/s, accepted/drafted


SEED = (
    SeedTarget(
        "Qwen3-32B", (10.4, 11.0), 24.9,
        ((2, 11.0, 17.9, 0.72), (4, 10.2, 21.3, 0.59), (6, 10.7, 23.4, 0.56)),
    ),
    SeedTarget("Qwen3-14B", (22.5, 24.1), 43.5, ((2, 24.1, 31.6, 0.71),)),
)  # fmt: skip


def one_step_round_ms(step_ms: float) -> dict[int, float]:
    """t_v(k) on Strix Halo's Vulkan path: one plain step for k <= 7."""
    return {k: step_ms for k in range(1, MAX_K_ONE_STEP + 1)}


def turns_tok_s(a: float, k: int, step_ms: float, draft_ms: float, resync_ms: float) -> float:
    """The seed's first version: draft k, then verify (no overlap)."""
    return 1e3 * expected_tokens_per_round(a, k) / (step_ms + resync_ms + k * draft_ms)


def engine_efficiency(result_path: Path) -> float | None:
    """Median meas/overlap of the proxy rows of a bench result (re-summarised)."""
    from proxy.bench.stats import summary_rows

    result = json.loads(result_path.read_text())
    shape = (result.get("options") or {}).get("draft_shape", "core")
    rows = summary_rows(result["runs"], result["instances"], result.get("round_costs"), shape)
    values = [r["meas_over_overlap"] for r in rows if r["kind"] == "proxy"]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def prediction_lines(
    efficiency: float, acceptance: list[float] | None = None,
    draft_ms: float = NPU_DRAFT_MS, resync_ms: float = NPU_DRAFT_MS,
) -> list[str]:  # fmt: skip
    lines = [
        "PREDICTION (cost model on the seed's published Strix Halo numbers; not measured)",
        "",
        f"t_d = {draft_ms:.1f} ms/token (NPU 0.6B), t_resync = {resync_ms:.1f} ms, "
        f"t_v(k) = one plain step for k <= {MAX_K_ONE_STEP}; engine efficiency "
        f"(proxy meas/overlap) = {efficiency:.2f}",
        "",
        "check: the taking-turns model against the seed's measured NPU rows",
        "| target | k | accepted/drafted | a | seed NPU tok/s | model tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for target in SEED:
        for k, plain, measured, ratio in target.npu_rows:
            a = acceptance_from_ratio(ratio, k)
            model = turns_tok_s(a, k, 1e3 / plain, draft_ms, resync_ms)
            lines.append(
                f"| {target.name} | {k} | {ratio:.2f} | {a:.3f} | {measured:.1f} | {model:.1f} |"
            )
    lines += [
        "",
        "| target | a | plain tok/s | seed builtin | ideal (k) | overlap (k) | "
        "predicted proxy | proxy / builtin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for target in SEED:
        for a in _acceptances(target, acceptance):
            cells = []
            for plain in target.plain_tok_s:
                rounds = one_step_round_ms(1e3 / plain)
                ideal = ideal_ceiling(a, rounds)
                overlap = overlap_ceiling(a, rounds, draft_ms, resync_ms)
                assert ideal is not None and overlap is not None
                cells.append((ideal, overlap, efficiency * overlap.tokens_per_s))
            low, high = cells[0], cells[-1]
            lines.append(
                f"| {target.name} | {a:.2f} | {target.plain_tok_s[0]:g}-{target.plain_tok_s[1]:g}"
                f" | {target.builtin_tok_s:g}"
                f" | {low[0].tokens_per_s:.1f}-{high[0].tokens_per_s:.1f} ({high[0].k})"
                f" | {low[1].tokens_per_s:.1f}-{high[1].tokens_per_s:.1f} ({high[1].k})"
                f" | {low[2]:.1f}-{high[2]:.1f}"
                f" | {low[2] / target.builtin_tok_s:.2f}-{high[2] / target.builtin_tok_s:.2f}x |"
            )
    lines += ["", *outcome_lines(efficiency, acceptance, draft_ms, resync_ms)]
    lines += [
        "",
        "ideal: max over k of E(k)/t_v(k); overlap: max over k of E(k)/T(k), "
        "T(k) = t_v(k) + (1 - a^(k+1))(t_resync + k t_d); predicted proxy = efficiency x "
        "overlap. Ranges follow the seed's plain range. a: solved from the seed's "
        "accepted/drafted at its k (or --predict-acceptance).",
    ]
    return lines


def _acceptances(target: SeedTarget, given: list[float] | None) -> list[float]:
    """The acceptances to predict at: the given ones, else the median a solved from
    the seed's NPU rows."""
    return given or [
        statistics.median(acceptance_from_ratio(r, k) for k, _, _, r in target.npu_rows)
    ]


def outcome_lines(
    efficiency: float, acceptance: list[float] | None, draft_ms: float, resync_ms: float
) -> list[str]:
    """The same targets if the drafter drafted OUTCOME_LINES likely outcomes at once
    (not built: what it would be worth, at the engine's measured efficiency)."""
    lines = [
        f"if the NPU drafted {OUTCOME_LINES} likely outcomes in one batch (the all-accepted "
        "line and the runner-up lines after the first rejection points; not built):",
        "| target | a | runner-up hits h | batch cost | ceiling (k) | predicted proxy "
        "| proxy / builtin |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in SEED:
        grid = itertools.product(_acceptances(target, acceptance), RUNNER_UP_HITS, NPU_BATCH_COST)
        for a, hits, cost in grid:
            low, high = (
                multi_outcome_ceiling(
                    a,
                    one_step_round_ms(1e3 / plain),
                    draft_ms,
                    resync_ms,
                    OUTCOME_LINES,
                    hits,
                    cost,
                )
                for plain in (target.plain_tok_s[0], target.plain_tok_s[-1])
            )
            assert low is not None and high is not None
            slow, fast = efficiency * low.tokens_per_s, efficiency * high.tokens_per_s
            lines.append(
                f"| {target.name} | {a:.2f} | {hits:g} | {cost:g}x "
                f"| {low.tokens_per_s:.1f}-{high.tokens_per_s:.1f} ({high.k}) "
                f"| {slow:.1f}-{fast:.1f} "
                f"| {slow / target.builtin_tok_s:.2f}-{fast / target.builtin_tok_s:.2f}x |"
            )
    return lines


def print_prediction(
    result_path: Path | None, efficiency: float | None, acceptance: list[float] | None
) -> int:
    if efficiency is None and result_path is not None:
        efficiency = engine_efficiency(result_path)
        if efficiency is None:
            print(f"{result_path}: no proxy row with meas/overlap; using efficiency 1.0")
    print("\n".join(prediction_lines(efficiency if efficiency is not None else 1.0, acceptance)))
    return 0
