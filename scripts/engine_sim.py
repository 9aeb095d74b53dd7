"""The engine alone against a simulated server: how close it gets to its ceilings.

The real engine (asyncio loop, drafter thread, policies) runs against a fake server
whose verify round of k drafts takes a chosen time t_v(k) (e.g. the H200 rows of
docs/BENCHMARKS.md), with an oracle drafter of chosen acceptance and per-token delay.
Nothing else shares the machine's time with the engine, so this measures the engine's
scheduling, not the host: tok/s against the free-draft ceiling E(k)/t_v(k) at the
best k, and against the naive-overlap model (proxy/bench/costmodel.py).

    PYTHONPATH=$PWD python scripts/engine_sim.py --verify-ms 17.9,20.1,22.1,23.7,24.4,25.0 \\
        --delay-ms 2.5 --acceptance 0.77 --config 'default=' \\
        --config 'marginal=draft_length=marginal early_draft=0'

A config is NAME=space-separated key=value pairs: draft_length (formula|marginal),
early_draft (0|1), overlap (auto|on|off), adaptive (0|1), k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

from npu_draft.oracle import OracleConfig, OracleDraftModel
from proxy.data.verify import VerifyResult
from proxy.engine import AsyncSessionDrafter, EngineSettings, Generation, GenerationParams
from proxy.engine.server_text import PieceCache


@dataclass
class SimServer:
    """Greedy continuation = a fixed script; a verify of k drafts sleeps t_v(k)."""

    script: list[int]
    n_prompt: int
    verify_ms: list[float]  # index k-1 -> ms (k = 0 costs the k = 1 time)

    async def verify(self, context, draft, sampling=None, seed=0):
        k = max(len(draft), 1)
        ms = self.verify_ms[min(k, len(self.verify_ms)) - 1]
        await asyncio.sleep(ms / 1e3)
        out = []
        for i in range(len(draft) + 1):
            token = self.script[len(context) + i - self.n_prompt]
            out.append(VerifyResult(token, f"<{token}>", False, 0, id_slot=0))
        return out


def e_over_t(a: float, verify_ms: list[float]) -> tuple[float, int]:
    """The free-draft ceiling: max over k of E(k) / t_v(k), tok/s, and its k."""
    rates = [((1 - a ** (k + 1)) / (1 - a) / (ms / 1e3), k) for k, ms in enumerate(verify_ms, 1)]
    return max(rates)


def naive(a: float, verify_ms: list[float], t_d: float) -> tuple[float, int]:
    """Drafting ahead along the all-accepted line only: max over k of E(k) / T(k)."""
    rates = []
    for k, ms in enumerate(verify_ms, 1):
        t = ms + (1 - a ** (k + 1)) * k * t_d
        rates.append(((1 - a ** (k + 1)) / (1 - a) / (t / 1e3), k))
    return max(rates)


async def run_config(name: str, options: dict[str, str], args) -> dict:
    k_max = int(options.get("k", args.k))
    n_prompt = 16
    script = [1000 + (i * 7919) % 50000 for i in range(args.n_predict * args.requests + 64)]
    prompt = list(range(1, n_prompt + 1))
    model = OracleDraftModel(
        [(prompt, script)],
        OracleConfig(acceptance=args.acceptance, delay_ms=args.delay_ms, vocab_size=60000),
    )
    settings = EngineSettings(
        k=k_max,
        adaptive=options.get("adaptive", "1") == "1",
        overlap=options.get("overlap", "on"),  # type: ignore[arg-type]
        early_draft=options.get("early_draft", "1") == "1",
        draft_length=options.get("draft_length", "formula"),  # type: ignore[arg-type]
    )
    # shared by the requests, as a proxy shares them
    policies = settings.policies().for_request(None)
    server = SimServer(script, n_prompt, args.verify)
    tokens = 0
    rounds = []
    wall = 0.0
    for _ in range(args.requests):
        generation = Generation(
            server, prompt, GenerationParams(n_predict=args.n_predict), 100000,
            AsyncSessionDrafter(model.open_session()), PieceCache(server),
            settings=settings, policies=policies,
        )  # fmt: skip
        started = time.perf_counter()
        out = [event.token async for event in generation.run()]
        wall += time.perf_counter() - started
        assert out == script[: args.n_predict], "output differs from the server's"
        tokens += len(out)
        rounds += generation.result.rounds[1:]  # the first round has no policy yet
    n = len(rounds)
    row = {
        "config": name,
        "tok_s": tokens / wall,
        "k_mean": sum(r.n_drafted for r in rounds) / n,
        "tokens_per_round": sum(r.n_committed for r in rounds) / n,
        "verify_ms": sum(r.verify_ms for r in rounds) / n,
        "draft_wait_ms": sum(r.draft_ms for r in rounds) / n,
        "overhead_ms": sum(r.overhead_ms for r in rounds) / n,
        "reused": sum(r.n_reused for r in rounds) / n,
    }
    # the oracle's realised acceptance on this script (a fixed draw): the ceilings at it
    accepted = sum(r.n_accepted for r in rounds)
    rejected = sum(1 for r in rounds if r.n_accepted < r.n_drafted)
    row["a_real"] = accepted / max(accepted + rejected, 1)
    for key in ("server_idle_ms", "drafter_idle_ms"):
        if hasattr(rounds[0], key):
            row[key] = sum(getattr(r, key) for r in rounds) / n
    return row


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify-ms", required=True, help="t_v(k) for k = 1, 2, ...")
    parser.add_argument("--delay-ms", type=float, default=2.5)
    parser.add_argument("--acceptance", type=float, default=0.77)
    parser.add_argument("-k", type=int, default=6)
    parser.add_argument("-n", "--n-predict", type=int, default=200)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--config", action="append", default=[])
    args = parser.parse_args()
    args.verify = [float(v) for v in args.verify_ms.split(",")][: args.k]
    ideal, k_ideal = e_over_t(args.acceptance, args.verify)
    overlap, k_overlap = naive(args.acceptance, args.verify, args.delay_ms)
    rows = []
    for config in args.config or ["default="]:
        name, _, rest = config.partition("=")
        options = dict(item.split("=", 1) for item in rest.split())
        row = await run_config(name, options, args)
        row["meas/ideal"] = row["tok_s"] / ideal
        row["meas/overlap"] = row["tok_s"] / overlap
        # the same against ceilings at the acceptance the oracle realised in this run
        row["meas/ideal@a"] = row["tok_s"] / e_over_t(row["a_real"], args.verify)[0]
        row["meas/overlap@a"] = row["tok_s"] / naive(row["a_real"], args.verify, args.delay_ms)[0]
        rows.append(row)
    print(json.dumps({"ideal_tok_s": ideal, "ideal_k": k_ideal, "overlap_tok_s": overlap,
                      "overlap_k": k_overlap, "rows": rows}, indent=1))  # fmt: skip
    print(f"ideal {ideal:.1f} tok/s (k={k_ideal}), naive overlap {overlap:.1f} (k={k_overlap})")
    head = list(rows[0])
    print(" | ".join(head))
    for row in rows:
        print(" | ".join(str(row[h]) if isinstance(row[h], str) else f"{row[h]:.2f}" for h in head))


if __name__ == "__main__":
    asyncio.run(main())
