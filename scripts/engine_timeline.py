"""Where a speculative round's time goes: the round timeline against the ceiling.

Starts one llama-server with the managed-mode flags, records the target's greedy
output for a few benchmark prompts (the oracle's references), then for each
configuration starts `npu-spec serve --upstream` with an oracle drafter (chosen
acceptance and per-token delay), sends the prompts, and reads the proxy's own
`/metrics` deltas: per round the verify time, the draft wait, the proxy's own work,
the server's idle gap before each verify and the drafter's idle time during it.

    PYTHONPATH=$PWD python scripts/engine_timeline.py --target T.gguf \\
        --acceptance 0.77 --delay-ms 3 -k 4 -n 96 --config 'defaults=' \\
        --config 'serial=--overlap off'

Ceilings per configuration, from its own measured rounds (proxy/bench/costmodel.py):
`ideal` = committed tokens / verify time (a free draft hidden under verification,
no proxy work); `naive` adds (1 - a^(k+1)) x (k x delay) per round (drafting ahead
only along the all-accepted line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from npu_draft.oracle import OracleConfig, write_oracle_folder
from proxy.bench.prompts import DEFAULT_PROMPTS, load_prompt_set
from proxy.server.llama_server import free_port
from proxy.server.managed import ServerLayout, managed_server

SUMS = ("draft_ms", "verify_ms", "overhead_ms", "server_idle_ms", "drafter_idle_ms")
GAUGES = ("draft_acceptance", "draft_token_ms", "draft_resync_ms", "draft_length_chosen")
COUNTERS = (
    "rounds_total",
    "draft_tokens_total",
    "accepted_tokens_total",
    "ahead_tokens_total",
    "plain_run_tokens_total",
)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(npu_spec_\w+)(\{[^}]*\})? ([-0-9.e+]+)$", line)
        if match and not match.group(2):
            out[match.group(1)] = float(match.group(3))
    return out


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        return await response.json()


async def wait_up(session: aiohttp.ClientSession, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


async def measure(args: argparse.Namespace) -> None:
    layout = ServerLayout(k=args.k, ctx_per_conversation=args.ctx, conversations=1)
    work = Path(tempfile.mkdtemp(prefix="engine-timeline-"))
    server = managed_server(
        Path(args.target), layout, threads=args.threads, slot_save_dir=work / "slots",
        log_path=work / "server.log",
    )  # fmt: skip
    await server.start()
    results = []
    try:
        async with aiohttp.ClientSession() as session:
            prompts = load_prompt_set(DEFAULT_PROMPTS)["prompts"][: args.prompts]
            refs = []
            for p in prompts:
                tokens = (
                    await post(session, server.base_url + "/tokenize",
                               {"content": p["text"], "add_special": True, "parse_special": True})
                )["tokens"]  # fmt: skip
                out = await post(session, server.base_url + "/completion", {
                    "prompt": tokens, "n_predict": args.n_predict, "temperature": 0,
                    "return_tokens": True, "cache_prompt": False,
                })  # fmt: skip
                refs.append((tokens, out["tokens"]))
            for name, options in args.configs:
                folder = write_oracle_folder(
                    work / f"oracle-{name}", refs,
                    OracleConfig(acceptance=args.acceptance, delay_ms=args.delay_ms),
                )  # fmt: skip
                port = free_port()
                cmd = [
                    sys.executable, "-m", "proxy.cli", "serve", "--upstream", server.base_url,
                    "--drafter", str(folder), "-k", str(args.k), "--port", str(port),
                    "--ctx", str(args.ctx), *shlex.split(options),
                ]  # fmt: skip
                with open(work / f"proxy-{name}.log", "w") as log:
                    proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_up(session, url)
                    warm_up = {"prompt": refs[0][0], "n_predict": 24, "temperature": 0}
                    await post(session, url + "/completion", warm_up)  # the policies' start
                    async with session.get(url + "/metrics") as response:
                        before = parse_metrics(await response.text())
                    wall = 0.0
                    generated = 0
                    for _ in range(args.repeats):
                        for tokens, expected in refs:
                            started = time.perf_counter()
                            out = await post(session, url + "/completion", {
                                "prompt": tokens, "n_predict": args.n_predict,
                                "temperature": 0, "return_tokens": True,
                            })  # fmt: skip
                            wall += time.perf_counter() - started
                            generated += len(out["tokens"])
                            if out["tokens"] != expected:
                                print(f"[{name}] output differs from the server's", flush=True)
                    async with session.get(url + "/metrics") as response:
                        after = parse_metrics(await response.text())
                finally:
                    proxy.terminate()
                    proxy.wait(10)
                d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
                results.append(summarise(name, options, d, after, wall, generated, args))
    finally:
        await server.stop()
    print(json.dumps(results, indent=1))
    print_table(results)


def summarise(name, options, d, after, wall, generated, args) -> dict:
    rounds = d.get("npu_spec_rounds_total", 0.0) or 1.0
    row = {"config": name, "options": options, "tok_s": generated / wall, "rounds": rounds}
    for key in SUMS:
        row[key] = d.get(f"npu_spec_{key}_sum", 0.0) / rounds
    for key in COUNTERS:
        row[key] = d.get(f"npu_spec_{key}", 0.0)
    for key in GAUGES:  # the policies' own measurements at the end
        row[key] = after.get(f"npu_spec_{key}", float("nan"))
    drafted = row["draft_tokens_total"]
    row["k_mean"] = drafted / rounds
    spec_tokens = generated - row["plain_run_tokens_total"]
    row["tokens_per_round"] = spec_tokens / rounds
    row["round_ms"] = row["verify_ms"] + row["draft_ms"] + row["overhead_ms"]
    row["ideal_tok_s"] = 1e3 * row["tokens_per_round"] / row["verify_ms"]
    a, k = args.acceptance, row["k_mean"]
    naive_ms = row["verify_ms"] + (1 - a ** (k + 1)) * k * args.delay_ms
    row["naive_tok_s"] = 1e3 * row["tokens_per_round"] / naive_ms
    row["spec_tok_s"] = 1e3 * row["tokens_per_round"] / row["round_ms"]
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        "config", "tok_s", "spec_tok_s", "ideal_tok_s", "naive_tok_s", "k_mean",
        "tokens_per_round", "round_ms", "verify_ms", "draft_ms", "overhead_ms",
        "server_idle_ms", "drafter_idle_ms", "ahead_tokens_total", "plain_run_tokens_total",
        *GAUGES,
    )  # fmt: skip
    print(" | ".join(head))
    for row in rows:
        print(" | ".join(
            str(row[h]) if isinstance(row[h], str) else f"{row[h]:.1f}" for h in head
        ))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--acceptance", type=float, default=0.77)
    parser.add_argument("--delay-ms", type=float, default=3.0)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("-n", "--n-predict", type=int, default=96)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--config", action="append", default=[], help="NAME=serve options (repeatable)"
    )
    args = parser.parse_args()
    args.configs = [tuple(c.split("=", 1)) for c in (args.config or ["defaults="])]
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
