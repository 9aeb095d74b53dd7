"""Emulated against measured, cell by cell: two `npu-spec bench` results side by side.

    python -m proxy.bench.regime.compare MEASURED.json EMULATED.json [--tolerance 0.1]

A cell is (context, mode kind, oracle delay in plain steps, proxy variant): the oracle's
delay in ms follows each run's own plain step, so cells match on X, not on ms. Prints
decode tok/s, its ratio and whether it lies within the tolerance, and beside it what
explains a miss: verify ms and prompt tokens per round, rounds, TTFT.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_VARIANT = re.compile(r"\[([^\]]*)\]$")


def cell_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    variant = _VARIANT.search(entry["mode"])
    return (
        entry["context"],
        entry.get("kind", entry["mode"].split("(")[0]),
        entry.get("oracle_delay_steps"),
        variant.group(1) if variant else "",
    )


def cells(result: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {cell_key(entry): entry for entry in result["summary"]}


def _f(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def compare(
    measured: dict[str, Any], emulated: dict[str, Any], tolerance: float
) -> tuple[list[str], int, int]:
    """Table lines, cells within the tolerance, cells compared."""
    ours = cells(emulated)
    lines = [
        "| context | mode | X | variant | measured tok/s | emulated tok/s | ratio | within | "
        "verify ms/round m / e | prompt tokens/round m / e | TTFT ms m / e |",
        "|---|---|---:|---|---:|---:|---:|---|---|---|---|",
    ]
    within = compared = 0
    for key, real in cells(measured).items():
        twin = ours.get(key)
        if twin is None:
            continue
        context, kind, x, variant = key
        m, e = real["summary"], twin["summary"]
        ratio = e["tokens_per_s_median"] / m["tokens_per_s_median"]
        ok = abs(ratio - 1) <= tolerance
        within += ok
        compared += 1
        lines.append(
            f"| {context} | {kind} | {_f(x, 2) if x is not None else '-'} | {variant or '-'} | "
            f"{_f(m['tokens_per_s_median'])} | {_f(e['tokens_per_s_median'])} | "
            f"{ratio:.2f} | {'yes' if ok else 'no'} | "
            f"{_f(m.get('verify_ms_per_round'))} / {_f(e.get('verify_ms_per_round'))} | "
            f"{_f(m.get('verify_prompt_tokens_per_round'))} / "
            f"{_f(e.get('verify_prompt_tokens_per_round'))} | "
            f"{_f(m.get('ttft_ms_median'), 0)} / {_f(e.get('ttft_ms_median'), 0)} |"
        )
    return lines, within, compared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regime-compare", description=__doc__)
    parser.add_argument("measured", type=Path)
    parser.add_argument("emulated", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args(argv)
    lines, within, compared = compare(
        json.loads(args.measured.read_text()), json.loads(args.emulated.read_text()),
        args.tolerance,
    )  # fmt: skip
    print("\n".join(lines))
    print(f"\n{within} of {compared} cells within ±{args.tolerance:.0%} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
