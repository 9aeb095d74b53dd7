"""A regime file from one `npu-spec verify-cost` run, with no fitting to bench results.

    python -m proxy.bench.regime.build VERIFY_COST.json --name h200-cuda-14b-f16 \\
      --description "..." -o proxy/bench/regime/regimes/h200-cuda-14b-f16.toml

The run needs parts a, b, c, d, f at two contexts (e.g. 512 and 4k) with c's
`--new-tokens` up to 64 or so; part e (idle slots full) gives the attention cost of
multi-token batches. From it:

- decode(m, n_kv) for each measured m: the server's own ms of the one-slot rows (b, c),
  warm (the later half of each row's samples), at the two contexts give a line in n_kv
  (the slot's cells, padded to 256, at the middle of the row's requests), with the
  span's slope for m tokens from rows a (m = 1) and rows e against d (a round's token
  count); m = 512 comes from the f rows' cold prefills (one micro-batch of 512 at 512,
  eight of them over a growing span at 4k);
- host: wall minus server ms of rows b, c and d, least squares over per request, per
  prompt and per thousand token ids; and per extra prompt of a round, what rows d's
  server ms exceed the one-slot decode of their tokens by;
- slots: f's save and restore wall ms at the two contexts, a line in tokens; with rows
  g (every other slot full), what the actions and the 512-token micro-batch cost per
  cell of the pool's span beyond the slot's own; with rows i, what a plain server's copy
  of a slot's prompt into its RAM prompt cache costs per token.

It prints each row's measured ms beside what the file charges for it; rows d (k+1
prompts over k+1 slots' cells) set only the cost per extra sampling slot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from proxy.bench.regime.kv_pool import padded_span as _padded
from proxy.bench.regime.regime_file import DecodeCost, HostCost


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _warm_server_ms(row: dict[str, Any]) -> float:
    """The server's ms of a one-slot row once its batch shape is warm: the median of the
    later half of its timed samples (the row's median where fewer than four were kept).
    On Vulkan the first uses of a batch shape ran slow past the untimed warm-up: the
    H200's 3-token batch at 512 took 40 ms four times, then 13.7 four times, and the
    median (27) made a one-draft round's 3 tokens dearer than 4 or 5. The rounds a
    server runs repeat the same few shapes, so they run warm."""
    samples = [s["server_ms"] for s in row.get("samples") or [] if s.get("server_ms") is not None]
    if len(samples) < 4:
        return float(row["server_ms_median"])
    return _median(samples[len(samples) // 2 :])


def _rows(result: dict[str, Any], part: str, variant: str) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["part"] == part and r["variant"] == variant]


def _one_slot_span(row: dict[str, Any], options: dict[str, Any]) -> int:
    """Cells the slot holds at the middle of a b/c row (it grows m tokens a request)."""
    m = int(row.get("m", 1))
    middle = options["warmup"] + options["repeats"] / 2
    return _padded(row["context"] + m * middle)


def _round_ids(row: dict[str, Any]) -> tuple[int, int]:
    """(prompts, token ids) of one request of a row."""
    if row["part"] in "de":
        k = int(row["k"])
        return k + 1, (k + 1) * row["context"]
    return 1, row["context"] + int(row.get("m", 1)) * 7


def _attention_slope(result: dict[str, Any], variant: str, low: int, high: int) -> float:
    """ms per cell of span for a token, from plain decoding (rows a) at two contexts:
    the server's own loop, where nothing else grows with the context."""
    a = {r["context"]: r for r in _rows(result, "a", variant)}
    plain = result["options"]["plain_tokens"] / 2
    n1, n2 = _padded(low + plain), _padded(high + plain)
    return (a[high]["ms_median"] - a[low]["ms_median"]) / (n2 - n1)


def _e_span(row: dict[str, Any]) -> int:
    """Cells a k+1-prompt round attends over when every idle slot holds a stale context
    of the same length (row e, "idle slots full")."""
    return _padded(int(row["np"]) * (row["context"] + int(row["k"]) + 8))


def span_slopes(result: dict[str, Any], variant: str, context: int) -> dict[int, float]:
    """ms per cell of span for a batch of the round's tokens, by token count: what the
    same k+1-prompt round costs the server with every idle slot full (row e) beyond the
    round with them empty (row d), over the cells that adds. Same tasks, same prompts:
    only the span differs."""
    d = {r["k"]: r for r in _rows(result, "d", variant) if r["context"] == context}
    e = {
        r["k"]: r
        for r in _rows(result, "e", variant)
        if r["context"] == context and r.get("idle_slots") == "full"
    }
    slopes: dict[int, float] = {}
    for k in sorted(set(d) & set(e)):
        cells = _e_span(e[k]) - _d_span(d[k])
        if cells > 0:
            extra = e[k]["server_ms_median"] - d[k]["server_ms_median"]
            slopes[int(d[k]["tokens_per_round"])] = max(0.0, extra / cells)
    return slopes


def _slope_by_tokens(plain_slope: float, slopes: dict[int, float]) -> Callable[[int], float]:
    """ms per cell for a batch of m tokens: plain decoding's slope at m = 1, rows e's at
    their rounds' token counts, linear between and flat beyond the last."""
    xs = (1, *sorted(m for m in slopes if m > 1))
    ys = (plain_slope, *(slopes[m] for m in xs[1:]))

    def slope(m: int) -> float:
        return ys[-1] if m >= xs[-1] else float(np.interp(m, xs, ys))

    return slope


def decode_table(result: dict[str, Any], variant: str) -> tuple[DecodeCost, float, dict[str, Any]]:
    """The decode table and the server's own cost per thousand prompt tokens of a task
    (what one-slot requests cost beyond plain decoding as the context grows)."""
    options = result["options"]
    contexts = sorted({r["context"] for r in result["rows"] if r["variant"] == variant})
    if len(contexts) < 2:
        raise ValueError("verify-cost must have run at two contexts (e.g. --context 512,4k)")
    low, high = contexts[0], contexts[-1]
    slope_at = _slope_by_tokens(
        _attention_slope(result, variant, low, high), span_slopes(result, variant, high)
    )
    by_m: dict[int, dict[int, tuple[int, float]]] = {}
    for row in _rows(result, "b", variant) + _rows(result, "c", variant):
        m = int(row.get("m", 1))
        point = (_one_slot_span(row, options), _warm_server_ms(row))
        by_m.setdefault(m, {})[row["context"]] = point
    per_task: list[float] = []
    for m, points in by_m.items():
        if low in points and high in points:
            (n1, t1), (n2, t2) = points[low], points[high]
            per_task.append((t2 - t1 - slope_at(m) * (n2 - n1)) / ((high - low) / 1e3))
    per_ktoken = max(0.0, statistics.median(per_task)) if per_task else 0.0
    tokens, fixed, per_kcell = [], [], []
    for m in sorted(by_m):
        if low not in by_m[m]:
            continue
        n1, t1 = by_m[m][low]
        tokens.append(m)
        per_kcell.append(round(slope_at(m) * 1000, 4))
        fixed.append(round(t1 - slope_at(m) * n1 - per_ktoken * low / 1e3, 3))
    f_rows = {r["context"]: r for r in _rows(result, "f", variant)}
    g_rows = {r["context"]: r for r in _rows(result, "g", variant)}
    prefill: dict[str, Any] = {}
    if low in f_rows and high in f_rows and low == 512:
        t_low = f_rows[low]["server_ms_median"]  # one micro-batch of 512 over 512 cells
        t_high = f_rows[high]["server_ms_median"]
        chunks = high // 512
        if high in g_rows:
            # the same prefill with every other slot full: only the span differs
            stale = stale_cells(g_rows[high])
            prefill_slope = (g_rows[high]["server_ms_median"] - t_high) / (chunks * stale)
            prefill_slope = max(0.0, prefill_slope)
            where = f"g against f at {high}: {g_rows[high]['server_ms_median']:.2f}"
        else:
            spans = sum(512 * (i + 1) for i in range(chunks))
            prefill_slope = (t_high - chunks * t_low) / (spans - chunks * 512)
            where = "the growth of f's prefills"
        tokens.append(512)
        per_kcell.append(round(prefill_slope * 1000, 4))
        fixed.append(round(t_low - prefill_slope * 512, 3))
        prefill = {
            "prefill ms": f"{t_low:.2f} at {low}, {t_high:.2f} at {high}; span slope from {where}"
        }
    return DecodeCost(tuple(tokens), tuple(fixed), tuple(per_kcell)), per_ktoken, prefill


def new_shape_ms(result: dict[str, Any], variant: str) -> float | None:
    """What a decode of another shape than the two before it costs more (`[decode]
    new_shape_ms`): rows m (the number accepted changing every round, so no two rounds
    in a row share a shape) against the mean of rows h at the same k and context (one
    shape repeated: the compute graph reused and, on CUDA, replayed). Median over the
    pairs; None without rows m."""
    h_rows: dict[tuple[int, int], list[float]] = {}
    for row in _rows(result, "h", variant):
        if row["server_ms_median"] is not None:
            h_rows.setdefault((row["context"], row["k"]), []).append(row["server_ms_median"])
    diffs = [
        row["server_ms_median"] - statistics.fmean(h_rows[(row["context"], row["k"])])
        for row in _rows(result, "m", variant)
        if row["server_ms_median"] is not None and (row["context"], row["k"]) in h_rows
    ]
    return round(max(0.0, statistics.median(diffs)), 3) if diffs else None


def stale_cells(row: dict[str, Any]) -> int:
    """Cells the other slots hold in a row g (each a stale context of the row's length)."""
    return (int(row["np"]) - 1) * int(row["context"])


def _d_span(row: dict[str, Any]) -> int:
    """Cells a k+1-prompt round attends over: k+1 slots holding the context."""
    k = int(row["k"])
    return _padded((k + 1) * (row["context"] + k + 8))


def host_fit(
    result: dict[str, Any], variant: str, decode: DecodeCost, per_ktoken: float
) -> HostCost:
    """Per request, prompt and thousand ids from rows b, c and d (wall minus server ms);
    then per extra sampling slot from what rows d's server ms exceed the one-slot
    decode of their tokens by."""
    rows = [r for p in "bcd" for r in _rows(result, p, variant) if r.get("overhead_ms_median")]
    a = np.array([[1.0, *(_round_ids(r)[0], _round_ids(r)[1] / 1e3)] for r in rows])
    y = np.array([r["overhead_ms_median"] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    request, prompt, kid = (max(0.0, float(c)) for c in coef)
    d_rows = _rows(result, "d", variant)
    extra = np.array([float(r["k"]) for r in d_rows])
    excess = np.array(
        [
            r["server_ms_median"]
            - decode.ms(int(r["tokens_per_round"]), _d_span(r))
            - per_ktoken * (int(r["k"]) + 1) * r["context"] / 1e3
            for r in d_rows
        ]
    )
    per_sample = float(extra @ excess / (extra @ extra)) if d_rows else 0.0
    return HostCost(
        per_request_ms=round(request, 3),
        per_prompt_ms=round(prompt, 4),
        per_kid_ms=round(kid, 4),
        per_extra_sample_ms=round(max(0.0, per_sample), 4),
        server_per_ktoken_ms=round(per_ktoken, 4),
    )


def slot_fit(result: dict[str, Any], variant: str) -> dict[str, float]:
    f_rows = sorted(_rows(result, "f", variant), key=lambda r: r["context"])
    if len(f_rows) < 2:
        raise ValueError("verify-cost must have run part f at two contexts")
    out: dict[str, float] = {}
    for what in ("save", "restore"):
        points = [
            (r["context"], _median([s[f"{what}_wall_ms"] for s in r["samples"]])) for r in f_rows
        ]
        (l1, t1), (l2, t2) = points[0], points[-1]
        per_k = (t2 - t1) / (l2 - l1) * 1000
        out[f"{what}_ms_per_ktoken"] = round(per_k, 3)
        out[f"{what}_action_ms"] = t1 - per_k * l1 / 1000
    out["action_ms"] = round(
        max(0.0, min(out.pop("save_action_ms"), out.pop("restore_action_ms"))), 3
    )
    by_context = {r["context"]: r for r in f_rows}
    g_rows = [r for r in _rows(result, "g", variant) if r["context"] in by_context]
    if g_rows:  # the same actions with every other slot full, at the highest context
        g = max(g_rows, key=lambda r: r["context"])
        f = by_context[g["context"]]
        for what in ("save", "restore"):
            extra = _median([s[f"{what}_wall_ms"] for s in g["samples"]]) - _median(
                [s[f"{what}_wall_ms"] for s in f["samples"]]
            )
            out[f"{what}_ms_per_span_kcell"] = round(max(0.0, extra) / (stale_cells(g) / 1e3), 4)
    i_rows = _rows(result, "i", variant)
    if i_rows:  # the plain server's prompt-cache copy, from the longest context
        i = max(i_rows, key=lambda r: r["context"])
        save = _median([s["save_ms"] for s in i["samples"]])
        out["prompt_cache_save_ms_per_ktoken"] = round(max(0.0, save) / i["context"] * 1e3, 3)
    return out


def check_rows(
    result: dict[str, Any], variant: str, decode: DecodeCost, host: HostCost
) -> list[str]:
    """Measured wall ms of each row beside the file's charge for it."""
    options = result["options"]
    lines = [f"{'row':<34} {'ctx':>5} {'measured':>9} {'charged':>9} {'ratio':>6}"]
    for row in result["rows"]:
        if row["variant"] != variant or row["part"] not in "abcde":
            continue
        if row["part"] == "e" and row.get("idle_slots") != "full":
            continue
        if row["part"] == "a":
            span = _padded(row["context"] + options["plain_tokens"] / 2)
            charged = decode.ms(1, span)
        elif row["part"] in "de":
            n_prompts, n_ids = _round_ids(row)
            span = _d_span(row) if row["part"] == "d" else _e_span(row)
            charged = decode.ms(int(row["tokens_per_round"]), span)
            charged += host.request_ms(n_prompts, n_ids) + host.per_extra_sample_ms * row["k"]
            charged += host.server_per_ktoken_ms * n_ids / 1e3
        else:
            n_prompts, n_ids = _round_ids(row)
            charged = decode.ms(int(row.get("m", 1)), _one_slot_span(row, options))
            charged += host.request_ms(n_prompts, n_ids) + host.server_per_ktoken_ms * n_ids / 1e3
        measured = row["ms_median"]
        lines.append(
            f"{row['what']:<34} {row['context']:>5} {measured:>9.2f} {charged:>9.2f} "
            f"{charged / measured:>6.2f}"
        )
    return lines


ASSUMPTIONS = (
    "Between measured batch sizes the decode cost is linear in tokens (from the largest "
    "one-slot row to the 512-token micro-batch of a cold prefill).",
    "Attention's cost per cell of the pool's span depends on the batch's token count: "
    "at 1 token it is the slope of plain decoding (rows a) between the two contexts; at "
    "a k+1-prompt round's token count it is what the round costs with every idle slot "
    "full (rows e) beyond the same round with them empty (rows d), at the higher "
    "context; linear between those counts and flat beyond the largest. Without rows e, "
    "plain decoding's slope for every batch of up to 64 tokens. The 512-token "
    "micro-batch has its own slope: from the cold prefill with every other slot full "
    "(row g) against the same prefill alone (row f), else from the growth of f's prefills.",
    "What one-slot requests (rows b, c) cost the server beyond that as the context grows is "
    "work per prompt token of each task (server_per_ktoken_ms), charged on the server's "
    "thread when the task starts.",
    "Host work is charged per request before its prompts reach the slots; the per-request, "
    "per-prompt and per-token-id parts are a least-squares fit of rows b, c and d.",
    "What a k+1-prompt round costs the server beyond a one-slot batch of the same tokens "
    "grows by the same amount per extra prompt (least squares over rows d at both contexts).",
)
DECODE_SOURCE = (
    "server ms of the one-slot rows b and c at the lower context, less the attention slope "
    "of rows a and the per-token work; 512: the cold prefills of row f"
)
SLOTS_SOURCE_F = "row f's save and restore wall ms at two contexts"
SLOTS_SOURCE = (
    "row f's save and restore wall ms at two contexts; per cell of the pool's span, rows g "
    "(every other slot full) against f at the higher context"
)
PROMPT_CACHE_SOURCE = (
    "prompt_cache_save_ms_per_ktoken: rows i at the highest context, a plain server's new "
    "prompt while its slot held another, less the same on an emptied slot"
)
HOST_SOURCE = (
    "wall minus server ms of rows b, c and d; per_extra_sample_ms: rows d's server ms "
    "beyond the one-slot decode of their tokens, per prompt beyond the first"
)


def _assumptions() -> str:
    return ",\n".join(f"  {json.dumps(a)}" for a in ASSUMPTIONS) + ","


def _toml_list(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def _new_shape_line(result: dict[str, Any], variant: str) -> str:
    charge = new_shape_ms(result, variant)
    if charge is None:
        return "# new_shape_ms: not measured (verify-cost part m), so not charged\n"
    return (
        "# new_shape_ms: rows m (the accepted count changing every round) against the mean "
        f"of rows h at the same k\nnew_shape_ms = {charge:g}\n"
    )


def render(
    result: dict[str, Any], source: Path, name: str, description: str, variant: str
) -> tuple[str, list[str]]:
    decode, per_ktoken, prefill = decode_table(result, variant)
    host = host_fit(result, variant, decode, per_ktoken)
    slots = slot_fit(result, variant)
    plain = _rows(result, "a", variant)
    step = min(plain, key=lambda r: r["context"])["ms_median"] if plain else None
    where = (
        f"{source.name} (npu-spec verify-cost, {result.get('started_utc', '?')}, variant {variant})"
    )
    text = f'''# {description}
# Built by `python -m proxy.bench.regime.build` from {source.name}; no bench result was used.
name = "{name}"
description = "{description}"
plain_step_ms = {step:.3f}

assumptions = [
{_assumptions()}
]

[decode]
source = "{where}: {DECODE_SOURCE} ({prefill.get("prefill ms", "no row f")})"
ubatch = 512
tokens = {_toml_list(decode.tokens)}
fixed_ms = {_toml_list(decode.fixed_ms)}
per_kcell_ms = {_toml_list(decode.per_kcell_ms)}
{_new_shape_line(result, variant)}
[host]
source = "{where}: {HOST_SOURCE}"
per_request_ms = {host.per_request_ms:g}
per_prompt_ms = {host.per_prompt_ms:g}
per_kid_ms = {host.per_kid_ms:g}
per_extra_sample_ms = {host.per_extra_sample_ms:g}
server_per_ktoken_ms = {host.server_per_ktoken_ms:g}

[slots]
source = "{where}: {SLOTS_SOURCE if "save_ms_per_span_kcell" in slots else SLOTS_SOURCE_F}"
action_ms = {slots["action_ms"]:g}
save_ms_per_ktoken = {slots["save_ms_per_ktoken"]:g}
restore_ms_per_ktoken = {slots["restore_ms_per_ktoken"]:g}
'''
    for what in ("save", "restore"):
        if f"{what}_ms_per_span_kcell" in slots:
            text += f"{what}_ms_per_span_kcell = {slots[f'{what}_ms_per_span_kcell']:g}\n"
    if "prompt_cache_save_ms_per_ktoken" in slots:
        text += (
            f"# {PROMPT_CACHE_SOURCE}\n"
            f"prompt_cache_save_ms_per_ktoken = {slots['prompt_cache_save_ms_per_ktoken']:g}\n"
        )
    return text, check_rows(result, variant, decode, host)


def joined_rows(
    rows: list[dict[str, Any]], extra: list[dict[str, Any]], parts: set[str]
) -> list[dict[str, Any]]:
    """`rows` and those of `extra` whose part is not in `parts` (the first file's): a
    later file adds parts (i; h and m for the new-shape charge) and never replaces a
    row the file's other charges come from, such as plain decoding's rows a."""
    return [*rows, *(r for r in extra if r["part"] not in parts)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regime-build", description=__doc__)
    parser.add_argument(
        "verify_cost", type=Path, nargs="+",
        help="verify-cost results; rows of later files join the first's for the parts it "
        "lacks (e.g. part i, or parts h and m, measured later on the same machine)",
    )  # fmt: skip
    parser.add_argument("--name", required=True)
    parser.add_argument("--description", default="")
    parser.add_argument("--variant", help="the verify-cost variant (default: the first)")
    parser.add_argument("-o", "--out", type=Path)
    args = parser.parse_args(argv)
    first, *more = args.verify_cost
    result = json.loads(first.read_text())
    parts = {r["part"] for r in result["rows"]}
    for path in more:
        extra = json.loads(path.read_text())
        result["rows"] = joined_rows(result["rows"], extra["rows"], parts)
        result["started_utc"] = (
            f"{result.get('started_utc', '?')}; {path.name}: {extra.get('started_utc', '?')}"
        )
    variant = args.variant or result["rows"][0]["variant"]
    text, check = render(result, first, args.name, args.description or args.name, variant)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    print("\n".join(check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
