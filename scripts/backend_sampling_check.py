#!/usr/bin/env python3
"""Greedy verify rounds and plain runs with llama-server's sampling on the host (its
default) against sampling on the backend (`backend_sampling`, `--backend-sampling on`),
on one managed server, alternating request by request. Prints a table: per way, the
median wall and server ms of a round of k+1 prompts, how far apart the round's prompts
finished inside the server (the host samples them one after another), and the ms a
token of 16-token plain runs; then whether the two ways' tokens agreed.

    python scripts/backend_sampling_check.py --model target.gguf -k 4 --rounds 40 \\
        --server-arg '-ngl 99 -fa on'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from proxy.server.managed import ServerLayout, managed_server
from proxy.server.upstream import UpstreamClient

RUN_TOKENS = 16
WAYS = {"host sampling": False, "backend sampling": True}


async def measure(model: Path, k: int, rounds: int, server_args: list[str]) -> dict:
    server = managed_server(model, ServerLayout(k=k, ctx_per_conversation=2048),
                            extra_args=server_args)  # fmt: skip
    await server.start()
    clients = {way: UpstreamClient(server.base_url, backend_sampling=on)
               for way, on in WAYS.items()}  # fmt: skip
    try:
        text = "def fibonacci(n):\n    " * 40
        tokens = (await clients["host sampling"].tokenize(text))[:500]
        rows = {way: {"wall": [], "server": [], "spread": [], "run": []} for way in WAYS}
        equal = {"rounds": 0, "runs": 0}
        for i in range(rounds):
            out: dict[str, tuple[list[int], list[int]]] = {}
            for way in list(WAYS)[:: 1 if i % 2 == 0 else -1]:  # each way first in turn
                client, row = clients[way], rows[way]
                draft = [tokens[(i * 7 + j) % len(tokens)] for j in range(k)]
                start = time.perf_counter()
                results = await client.verify(tokens, draft)
                row["wall"].append((time.perf_counter() - start) * 1e3)
                server_ms = [r.server_ms for r in results]
                row["server"].append(max(server_ms))
                row["spread"].append(max(server_ms) - min(server_ms))
                run = await client.plain_run(tokens[: 300 + i], RUN_TOKENS)
                row["run"].append(run.server_ms / len(run.tokens))
                out[way] = ([r.token for r in results], run.tokens)
            host, backend = out["host sampling"], out["backend sampling"]
            equal["rounds"] += host[0] == backend[0]
            equal["runs"] += host[1] == backend[1]
        return {
            "k": k, "rounds": rounds, "equal": equal,
            "ways": {way: {key: round(statistics.median(v), 3) for key, v in row.items()}
                     for way, row in rows.items()},
        }  # fmt: skip
    finally:
        for client in clients.values():
            await client.close()
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the target GGUF")
    parser.add_argument("-k", type=int, default=4, help="drafts a round (k+1 prompts)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds and runs each way")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="more llama-server arguments, split like a shell line")  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, help="the results as JSON")
    args = parser.parse_args(argv)
    server_args = [part for line in args.server_arg for part in shlex.split(line)]
    result = asyncio.run(measure(args.model, args.k, args.rounds, server_args))
    print("| way | prompts' spread ms | round wall ms | round server ms | plain run ms a token "
          "(server) |\n|---|---:|---:|---:|---:|")  # fmt: skip
    for way, row in result["ways"].items():
        print(f"| {way} | {row['spread']:.2f} | {row['wall']:.2f} | {row['server']:.2f} | "
              f"{row['run']:.2f} |")  # fmt: skip
    equal = result["equal"]
    print(f"\nk = {result['k']}; tokens equal in {equal['rounds']}/{result['rounds']} rounds and "
          f"{equal['runs']}/{result['rounds']} runs")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))
    return 0 if equal["rounds"] == equal["runs"] == result["rounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
