"""Does the regime server charge what its file says? A benchmark, not a test.

Starts the regime server with a regime file (default h200-cuda-14b-f16), sends requests
whose charge the file fixes (a one-token request on a cached prompt, a plain run, a
k+1-prompt verify round, a cold prefill, a save and a restore), and prints each one's
wall ms beside the charge. The difference is the event loop's scheduling and this
process's own HTTP and JSON work, which the clock does not model.

    python scripts/regime_clock.py [--regime NAME] [--repeats 20] [--context 512]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from proxy.bench.regime.__main__ import write_launcher
from proxy.bench.regime.kv_pool import padded_span as _span
from proxy.bench.regime.regime_file import load_regime
from proxy.server.llama_server import LlamaServerProcess
from proxy.server.upstream import GREEDY_VERIFY_PARAMS, UpstreamClient


async def measure(regime_name: str, repeats: int, context: int) -> list[tuple[str, float, float]]:
    regime = load_regime(regime_name)
    host, decode = regime.host, regime.decode
    work = Path(tempfile.mkdtemp(prefix="regime-clock-"))
    launcher = write_launcher(regime_name, work / "regime-server")
    flags = ["-np", "8", "-c", str(8 * (context + 512)), "-kvu", "--metrics",
             "--slot-save-path", str(work)]  # fmt: skip
    server = LlamaServerProcess(launcher, work / "regime.gguf", flags)
    rng = random.Random(0)
    rows: dict[str, list[tuple[float, float]]] = {}

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    async def timed(name: str, charge: float, call) -> None:
        start = time.perf_counter()
        await call
        rows.setdefault(name, []).append(((time.perf_counter() - start) * 1e3, charge))

    await server.start(120)
    try:
        async with UpstreamClient(server.base_url) as client:
            for _ in range(repeats):
                for slot in range(8):
                    await client.slot_action(slot, "erase", "")
                ctx = ids(context)
                cold = sum(decode.ms(min(512, context - i), _span(i + 512))
                           for i in range(0, context, 512))  # fmt: skip
                start = time.perf_counter()
                first = await client.completion({"prompt": ctx, **GREEDY_VERIFY_PARAMS})
                rows.setdefault("cold prefill", []).append(
                    ((time.perf_counter() - start) * 1e3, cold + host.request_ms(1, context)
                     + host.server_per_ktoken_ms * context / 1e3)
                )  # fmt: skip
                slot = int(first["id_slot"])
                others = [i for i in range(8) if i != slot][:3]
                await timed("save", regime.slots.save_ms(context),
                            client.slot_action(slot, "save", "c.bin"))  # fmt: skip
                for other in others:
                    await timed("restore", regime.slots.restore_ms(context),
                                client.slot_action(other, "restore", "c.bin"))  # fmt: skip
                # four slots hold ctx: prompt i re-reads the last token or adds i drafts
                verify = decode.ms(1 + 1 + 2 + 3, _span(4 * context + 8))
                verify += host.request_ms(4, 4 * context + 6) + 3 * host.per_extra_sample_ms
                verify += host.server_per_ktoken_ms * (4 * context + 6) / 1e3
                await timed("verify round, k = 3", verify, client.verify(ctx, ids(3)))
                one = decode.ms(1, _span(4 * context + 8)) + host.request_ms(1, context + 1)
                one += host.server_per_ktoken_ms * (context + 1) / 1e3
                await timed("1 new token", one, client.completion(
                    {"prompt": ctx + ids(1), **GREEDY_VERIFY_PARAMS}))  # fmt: skip
                plain = 32 * decode.ms(1, _span(4 * context + 40)) + host.request_ms(1, context)
                await timed("plain run, 32 tokens", plain, client.plain_run(ctx, 32))
    finally:
        await server.stop()
    return [
        (name, statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples))
        for name, samples in rows.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--regime", default="h200-cuda-14b-f16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    rows = asyncio.run(measure(args.regime, args.repeats, args.context))
    print(f"regime {args.regime}, context {args.context}, {args.repeats} repeats (medians)")
    print(f"{'request':<24} {'wall ms':>9} {'charged ms':>11} {'wall/charge':>12}")
    for name, wall, charge in rows:
        print(f"{name:<24} {wall:>9.2f} {charge:>11.2f} {wall / charge:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
