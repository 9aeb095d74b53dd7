#!/usr/bin/env python3
"""Draft-session time under glibc malloc settings (issue 30, docs/RELIABILITY.md).

One draft session as the proxy runs it on a 2-token draft length: a 39-token sync,
then 12 rounds of a 2-token draft followed by a sync (one accepted token and one
correction). Each variant runs in a child process of its own (the MALLOC_* variables
take effect when glibc starts), with `load_drafter` and the given drafter folder
alone: `--groups` groups of `--sessions` sessions, the model reloaded between groups
(as after drafter faults: glibc's dynamic mmap threshold rises when the first
model's blocks are freed). Variants alternate, `--rounds` times; the output is the
median session ms of each group.

    python scripts/draft_session_time.py --drafter .cache/test-models/small-same-.../draft \\
        --variant base= --variant arena2=MALLOC_ARENA_MAX=2 \\
        --variant mmap4m=MALLOC_MMAP_THRESHOLD_=4194304 --rounds 3 -o /tmp/times.json

A variant is NAME=ENV[,ENV...] (empty: glibc's defaults); `npu-spec serve`'s own
default (`proxy.native_memory.tune_malloc`) applies only where a variant sets
`NPU_SPEC_TUNE_MALLOC=1`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(drafter: str, sessions: int, groups: int) -> int:
    sys.path.insert(0, str(REPO))
    if os.environ.get("NPU_SPEC_TUNE_MALLOC") == "1":
        from proxy import native_memory

        native_memory.tune_malloc()
    from npu_draft.load import load_drafter

    model = load_drafter(drafter, "cpu")
    medians = []
    for group in range(groups):
        times = []
        for n in range(sessions + 1):  # the first one warms up
            session = model.open_session()
            tokens = list(range(1, 40))
            started = time.perf_counter()
            session.sync(tokens)
            for _ in range(12):
                draft = session.propose(2)
                tokens += [*list(draft.tokens)[:1], 7]
                session.sync(tokens)
            if n:
                times.append((time.perf_counter() - started) * 1e3)
            session.close()
        medians.append(round(statistics.median(times), 1))
        if group + 1 < groups:
            model.close()
            model = load_drafter(drafter, "cpu")
    print(json.dumps(medians))
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        return child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--variant", action="append", required=True, help="NAME=ENV[,ENV...]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("-o", "--out", type=Path)
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, env = spec.partition("=")
        variants[name] = dict(pair.split("=", 1) for pair in env.split(",") if pair)
    results: dict[str, list[list[float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            env.pop("NPU_SPEC_TUNE_MALLOC", None)
            env.update(variants[name])
            out = subprocess.run(
                [sys.executable, __file__, "--child", args.drafter, str(args.sessions),
                 str(args.groups)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            medians = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(medians)
            print(f"round {round_ + 1} {name:>12}: group medians {medians} ms", flush=True)
    summary = {
        name: {
            "env": variants[name],
            "runs": runs,
            "median_of_medians_ms": round(statistics.median(m for run in runs for m in run), 1),
            "median_after_reload_ms": round(statistics.median(run[-1] for run in runs), 1),
        }
        for name, runs in results.items()
    }
    for name, row in summary.items():
        print(f"{name:>12}: median of group medians {row['median_of_medians_ms']} ms, "
              f"after a reload {row['median_after_reload_ms']} ms", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "variants": summary}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
