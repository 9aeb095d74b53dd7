#!/usr/bin/env python3
"""What `--log-rounds` files say about batch shapes: per file, the steady rounds (no
first round, no copy, no catch-up) by drafts per round, padded or not, with their
batch sizes (the real prompts' tokens plus the pad's) and the server's median ms.

    python scripts/round_log_summary.py rounds-*.log
    python scripts/round_log_summary.py --verdict rounds-*.log
    python scripts/round_log_summary.py --generations rounds-*.log
    python scripts/round_log_summary.py --fill PLAIN_MS|RESULT.json rounds-*.log
    python scripts/round_log_summary.py --runs rounds-*.log

A padded run whose batch sizes are one number and whose server ms sit below the
unpadded rounds' is what `--pad-rounds` is for (docs/BENCHMARKS.md, "Why the H200's
rounds cost more than the ceiling's"). `--verdict` pools the files' rounds that were or
could have been padded and feeds them, in blocks of padded and unpadded rounds in turn
as `--pad-rounds auto` sends them, to the padding policy: which draft lengths it would
pad on that server (docs/BENCHMARKS.md, "Padding decided on the GPU").
`--generations` gives each generation's first round (the prefill and the slot copies
after it) apart from the rest, and the rest's tokens a second: what a cold request's
fill costs against the steady speed after it. `--fill PLAIN_MS` pools the
generations that stayed on the oracle's path, cold (the first round found less than half
of the context cached) apart from warm (most of it cached: the bench's exact-check re-runs
of a single turn, a chat's later turns); each file's first generation, the bench's
warm-up, is left out. It sets their rounds after the first against plain decoding at
PLAIN_MS a token, with and without the fill (the first round's time beyond its request:
the slot copies), and says how long a fill the median cold generation could have
afforded and still matched plain decoding. Given
the bench's RESULT.json instead of a number, it takes the plain step that run measured
(at its one context). One plain step serves every generation, so a chat's later turns,
decoded at longer contexts than the first, are set against a plain step a little too short.

`--runs` sets the plain runs' wall time against the server's own time inside them, by
what the drafter did beside them (timing itself, a shadow draft, nothing): per token,
medians, with the proxy's work after each run and the server's idle gap before it. The
server's time is its prompt and predicted ms: a run's prompt is the context less what
its slot holds, normally one token (each line's `n_context` and `cached` say). Where the
server's own ms a token exceed plain decoding's, something slowed the server itself (a
drafter on its GPU); where the wall time exceeds the server's, the requests (HTTP, the
server's request handling).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from proxy.bench.report import on_oracle_path
from proxy.data.records import RoundRecord
from proxy.policies.padding import BLOCK_ROUNDS, PaddingPolicy


def _records(lines: Iterable[str], kind: str) -> list[dict]:
    """The JSON records of the `--log-rounds` lines of one kind (anything else is skipped)."""
    out = []
    for line in lines:
        _, marker, rest = line.partition(f" {kind} {{")
        if marker:
            out.append(json.loads("{" + rest))
    return out


def rounds_of(lines: Iterable[str]) -> list[dict]:
    """The speculative rounds' records."""
    return _records(lines, "round")


def runs_of(lines: Iterable[str]) -> list[dict]:
    """The plain runs' records."""
    return _records(lines, "run")


def run_summary(runs: list[dict]) -> list[dict]:
    """Plain runs grouped by what the drafter did beside them: count, tokens, and the
    medians of wall and server ms a token, the proxy's ms after a run and the server's
    idle ms before one."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        if run["n_run_tokens"]:
            groups[run["beside"] or "nothing"].append(run)
    rows = []
    for beside, group in sorted(groups.items()):
        rows.append({
            "beside": beside, "runs": len(group),
            "tokens": sum(r["n_run_tokens"] for r in group),
            "wall_ms_per_token": statistics.median(r["run_ms"] / r["n_run_tokens"] for r in group),
            "server_ms_per_token": statistics.median(
                r["server_ms"] / r["n_run_tokens"] for r in group
            ),
            "overhead_ms": statistics.median(r["overhead_ms"] for r in group),
            "server_idle_ms": statistics.median(r["server_idle_ms"] for r in group),
        })  # fmt: skip
    return rows


def print_runs(paths: list[str]) -> None:
    for path in paths:
        print(path)
        for row in run_summary(runs_of(Path(path).read_text().splitlines())):
            print(
                f"  beside {row['beside']:8s} {row['runs']:4d} runs {row['tokens']:5d} tokens  "
                f"wall {row['wall_ms_per_token']:6.2f} ms/token  server "
                f"{row['server_ms_per_token']:6.2f}  after a run {row['overhead_ms']:6.2f} ms  "
                f"idle before {row['server_idle_ms']:6.2f} ms"
            )


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


def could_pad(rounds: list[dict]) -> list[RoundRecord]:
    """The rounds of one log that were padded or could have been, as the policy's
    records. Logs from before the `padded` field: a round could have been padded where
    it had as many drafts as the last and no slot copy or catch-up."""
    records, last = [], None
    for r in rounds:
        padded = r.get("padded")
        if "padded" not in r:
            same = r["n_drafted"] and r["n_drafted"] == last
            padded = True if r.get("pad") else (False if same else None)
        last = r["n_drafted"]
        if padded is not None and not (r["catch_up"] or r["copied"]):
            records.append(RoundRecord(
                n_drafted=r["n_drafted"], n_accepted=r["n_accepted"], n_committed=0,
                draft_ms=r["draft_ms"], verify_ms=r["verify_ms"],
                overhead_ms=r["overhead_ms"], padded=padded,
            ))  # fmt: skip
    return records


def padding_verdict(records: list[RoundRecord]) -> PaddingPolicy:
    """The policy after the records, fed in turns of a block of padded rounds and a
    block of unpadded ones (each side in its logged order)."""
    policy = PaddingPolicy("auto")
    sides = [[r for r in records if r.padded], [r for r in records if not r.padded]]
    for start in range(0, max(map(len, sides)), BLOCK_ROUNDS):
        for side in sides:
            for record in side[start : start + BLOCK_ROUNDS]:
                policy.observe(record)
    return policy


def print_verdict(paths: list[str]) -> None:
    records = [r for p in paths for r in could_pad(rounds_of(Path(p).read_text().splitlines()))]
    policy = padding_verdict(records)
    print(f"padded lengths: {policy.padded_lengths() or 'none'}")
    for k, length in sorted(policy.lengths.items()):
        ms = {side: length.verify_ms.get(side) for side in (True, False)}
        print(
            f"  k={k}  padded {ms[True] or 0:6.2f} ms x{length.verify_n[True]:<4d} "
            f"unpadded {ms[False] or 0:6.2f} ms x{length.verify_n[False]:<4d} "
            f"-> {({None: 'undecided', True: 'padded', False: 'unpadded'})[length.chosen]}"
        )


def generations(rounds: list[dict]) -> list[dict]:
    """Per generation (its rounds start at i = 0): the first round's prompt tokens
    found cached (0: cold), its ms and its copies' ms (save and restores, logs from
    before the `copies` field: None), and the later rounds' count, rounds without a
    draft, tokens committed and tokens a second (a round commits its accepted drafts
    and one token of the server's; a finished generation's last round may commit
    fewer)."""
    runs: list[list[dict]] = []
    for r in rounds:
        if r["i"] == 0 or not runs:
            runs.append([])
        runs[-1].append(r)
    rows = []
    for first, *rest in runs:
        copies = first.get("copies")
        later_ms = sum(r["round_ms"] for r in rest)
        request_ms = first.get("verify_ms", 0.0) + first.get("draft_ms", 0.0)
        tokens = sum(r["n_accepted"] + 1 for r in rest)
        rows.append({
            "cached": first["slots"][0][2] if first["slots"] else 0,
            "n_context": first.get("n_context"),
            "first_ms": first["round_ms"], "fill_ms": first["round_ms"] - request_ms,
            "later_ms": later_ms,
            "copies_ms": None if copies is None else sum(c[0] + c[1] for c in copies),
            "rounds": len(rest), "empty": sum(1 for r in rest if not r["n_drafted"]),
            "tokens": tokens, "tokens_per_s": 1e3 * tokens / later_ms if later_ms else None,
        })  # fmt: skip
    return rows


def print_generations(paths: list[str]) -> None:
    for path in paths:
        print(path)
        for row in generations(rounds_of(Path(path).read_text().splitlines())):
            copies = "-" if row["copies_ms"] is None else f"{row['copies_ms']:.1f}"
            speed = row["tokens_per_s"] or 0.0
            print(
                f"  cached {row['cached']:5d}  first round {row['first_ms']:7.1f} ms "
                f"(copies {copies})  then {row['rounds']:3d} rounds ({row['empty']} empty) "
                f"{row['tokens']:4d} tokens at {speed:6.1f} tok/s"
            )


def fill_sides(rows: list[dict], plain_ms: float) -> dict[str, dict]:
    """The generations on the oracle's path (at most the bench report's share of their
    later rounds without a draft, or 2), as "cold" and "warm": per side, each one's fill
    ms and its later rounds' speed as a multiple of plain decoding, without and with the
    fill; and the medians, with the fill the median cold generation could have cost and
    still decoded at plain speed (its tokens at plain speed less its rounds' time)."""
    sides: dict[str, dict] = {}
    for row in rows:
        if not row["later_ms"] or not on_oracle_path(row["empty"], row["rounds"]):
            continue
        side = sides.setdefault(
            "cold" if row["cached"] < (row["n_context"] or 0) / 2 else "warm",
            {"fill_ms": [], "rounds_x": [], "with_fill_x": [], "slack_ms": []},
        )
        plain_time = row["tokens"] * plain_ms
        side["fill_ms"].append(row["fill_ms"])
        side["rounds_x"].append(plain_time / row["later_ms"])
        side["with_fill_x"].append(plain_time / (row["later_ms"] + row["fill_ms"]))
        side["slack_ms"].append(plain_time - row["later_ms"])
    for side in sides.values():
        for key in ("fill_ms", "rounds_x", "with_fill_x", "slack_ms"):
            side["median_" + key] = statistics.median(side[key])
    return sides


def print_fill(plain_ms: float, paths: list[str]) -> None:
    # each file is one proxy of one bench run, whose first generation is the bench's
    # warm-up request (its rounds also explore the draft lengths): not measured
    rows = [g for p in paths for g in generations(rounds_of(Path(p).read_text().splitlines()))[1:]]
    sides = fill_sides(rows, plain_ms)
    for name in ("cold", "warm"):
        side = sides.get(name)
        if side is None:
            print(f"{name}: no generation on the oracle's path")
            continue
        fills = ", ".join(f"{ms:.0f}" for ms in side["fill_ms"])
        print(
            f"{name}: {len(side['fill_ms'])} generations, fill ms [{fills}]; rounds after "
            f"the first {side['median_rounds_x']:.2f}x plain, with the fill "
            f"{side['median_with_fill_x']:.2f}x"
        )
    if "cold" in sides:
        print(
            f"a cold generation matches plain with a fill of up to "
            f"{sides['cold']['median_slack_ms']:.0f} ms (median)"
        )


def plain_step_ms(given: str) -> float:
    """PLAIN_MS, or the plain step a bench result measured (`round_costs`, one context)."""
    if not given.endswith(".json"):
        return float(given)
    costs = json.loads(Path(given).read_text())["round_costs"]
    if len(costs) != 1:
        raise SystemExit(f"{given}: {len(costs)} contexts; give the plain ms instead")
    return float(next(iter(costs.values()))["plain_ms"])


def main(paths: list[str]) -> int:
    if paths[:1] == ["--fill"]:
        print_fill(plain_step_ms(paths[1]), paths[2:])
        return 0
    if paths[:1] == ["--verdict"]:
        print_verdict(paths[1:])
        return 0
    if paths[:1] == ["--runs"]:
        print_runs(paths[1:])
        return 0
    if paths[:1] == ["--generations"]:
        print_generations(paths[1:])
        return 0
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
