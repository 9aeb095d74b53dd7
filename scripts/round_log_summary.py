#!/usr/bin/env python3
"""What `--log-rounds` files say about batch shapes: per file, the steady rounds (no
first round, no copy, no catch-up) by drafts per round, padded or not, with their
batch sizes (the real prompts' tokens plus the pad's) and the server's median ms.

    python scripts/round_log_summary.py rounds-*.log

A padded run whose batch sizes are one number and whose server ms sit below the
unpadded rounds' is what `--pad-rounds` is for (docs/BENCHMARKS.md, "Why the H200's
rounds cost more than the ceiling's").
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path


def rounds_of(lines: Iterable[str]) -> list[dict]:
    """The JSON records of `--log-rounds` lines (anything else is skipped)."""
    out = []
    for line in lines:
        _, marker, rest = line.partition(" round {")
        if marker:
            out.append(json.loads("{" + rest))
    return out


def summary(rounds: list[dict]) -> list[dict]:
    """Steady rounds grouped by (drafts, padded): count, batch sizes, median server ms."""
    groups: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    for r in rounds:
        if r["i"] == 0 or r["catch_up"] or r["copied"] or not r["n_drafted"]:
            continue
        groups[(r["n_drafted"], bool(r.get("pad")))].append(r)
    rows = []
    for (k, padded), members in sorted(groups.items()):
        sizes = Counter(sum(s[1] for s in r["slots"]) + r.get("pad", 0) for r in members)
        rows.append({
            "k": k, "padded": padded, "rounds": len(members),
            "batch_sizes": dict(sorted(sizes.items())),
            "server_ms": statistics.median(r["server_ms"] for r in members),
            "verify_ms": statistics.median(r["verify_ms"] for r in members),
        })  # fmt: skip
    return rows


def main(paths: list[str]) -> int:
    for path in paths:
        rows = summary(rounds_of(Path(path).read_text().splitlines()))
        print(path)
        for row in rows:
            sizes = ", ".join(f"{n}x{c}" for n, c in row["batch_sizes"].items())
            print(
                f"  k={row['k']} {'padded' if row['padded'] else 'plain '} "
                f"{row['rounds']:4d} rounds  server {row['server_ms']:6.2f} ms  "
                f"verify {row['verify_ms']:6.2f} ms  batch sizes {sizes}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
