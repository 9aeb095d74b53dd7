#!/usr/bin/env python3
"""How many network round trips one llama_decode makes to each RPC server: a plain
decoding step and a verify round (k+1 prompts in one decode) side by side.

Starts N ggml-rpc-servers behind counting relays (no delay) and a llama-server with
the managed-mode verification flags and `--rpc` to the relays, then reads the relays'
reply and byte counts and llamacpp:n_decode_total around (a) a plain /completion of
`--tokens` tokens on a cached prompt and (b) verify rounds of k drafts (the proxy's
request). Round trips x the link's RTT, plus the bytes over its bandwidth, is what
each decode pays for the network.

python scripts/rpc_round_trips.py --models DIR -k 4
"""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from proxy.bench.rpc_stack import rpc_endpoints
from proxy.server.managed import ServerLayout, managed_server
from proxy.server.rpc import find_rpc_server
from proxy.server.upstream import UpstreamClient

PROMPT = "Once upon a time, in a land far away, there lived"


async def measure(args: argparse.Namespace) -> None:
    binary = find_rpc_server(args.rpc_server)
    layout = ServerLayout(k=args.k, ctx_per_conversation=1024)
    async with rpc_endpoints(binary, args.servers, 0, 1, None, relay=True) as (
        endpoints,
        relays,
    ):
        server = managed_server(
            args.models / "target.gguf",
            layout,
            binary=args.llama_server,
            threads=1,
            slot_save_dir=Path(tempfile.mkdtemp(prefix="rpc-rt-")),
            extra_args=["--rpc", ",".join(endpoints), "-ngl", "99", *args.server_arg],
        )
        await server.start()
        try:
            async with UpstreamClient(server.base_url) as upstream:
                prompt = await upstream.tokenize(PROMPT)
                body = {"prompt": prompt, "n_predict": args.tokens, "temperature": 0}
                first = await upstream.completion({**body, "return_tokens": True})
                generated = first["tokens"]

                async def count(action) -> tuple[int, int, int, int]:
                    before = (await upstream.n_decode_total(), *_counts(relays))
                    await action()
                    after = (await upstream.n_decode_total(), *_counts(relays))
                    return tuple(b - a for a, b in zip(before, after, strict=True))

                plain = await count(lambda: upstream.completion(body))  # prompt cached

                async def rounds() -> None:
                    for i in range(0, args.tokens - args.k, args.k + 1):
                        context = prompt + generated[:i]
                        await upstream.verify(context, generated[i : i + args.k])

                verify = await count(rounds)
        finally:
            await server.stop()
    for name, (decodes, replies, up, down) in (
        ("plain step", plain),
        (f"verify k={args.k}", verify),
    ):
        n = max(decodes, 1)
        print(
            f"{name}: {decodes} decodes; per decode {replies / n:.1f} round trips over "
            f"{args.servers} RPC servers, {up / n / 1e3:.0f} kB sent, "
            f"{down / n / 1e3:.0f} kB received"
        )


def _counts(relays) -> tuple[int, int, int]:
    return (
        sum(relay.replies for relay in relays),
        sum(relay.bytes["up"] for relay in relays),
        sum(relay.bytes["down"] for relay in relays),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="make-models folder")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--rpc-server", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="extra, repeatable")
    asyncio.run(measure(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
