#!/usr/bin/env python3
"""What a one-slot verify would allow, priced on a regime file (issue 29, item 6).

Through b11434's stock API the proxy verifies k drafts with k + 1 prompts in k + 1
slots, because a completion returns probabilities only for the tokens it generates:
`echo` (the prompt's own logprobs) is refused ("Only no echo is supported",
tools/server/server-common.cpp). If llama-server one day returned per-position
logprobs for a prompt, a round would be ONE prompt of k + 1 new tokens in one slot, the
batch llama.cpp's own drafting verifies. This prices that round on a regime file
(its measured or derived decode table and host costs), with the cost model's ceilings:

- ideal: a free draft, max over k of E(k) / t_v(k);
- overlap: the drafter drafting ahead along the all-accepted line while the server
  verifies (`costmodel.overlap_round_ms`, re-sync = one draft step).

A model on paper, not a measurement:

    python scripts/one_slot_ceiling.py strix-halo-vulkan-32b strix-halo-vulkan-14b \\
        --acceptance 0.8 --draft-ms 11
    python scripts/one_slot_ceiling.py h200-cuda-14b-f16 --acceptance 0.77 --draft-steps 0.12
"""

from __future__ import annotations

import argparse

from proxy.bench.costmodel import ideal_ceiling, overlap_ceiling
from proxy.bench.regime.regime_file import Regime, load_regime


def one_slot_round_ms(regime: Regime, k: int, context: int) -> float:
    """One request of one prompt (the whole context as ids, k + 1 of them new): the
    host's request cost and one decode of k + 1 tokens over the slot's cells."""
    host = regime.host.request_ms(1, context + k)
    return host + regime.decode.ms(k + 1, context + k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("regimes", nargs="+", help="regime names or files")
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-k", type=int, default=15)
    speed = parser.add_mutually_exclusive_group(required=True)
    speed.add_argument("--draft-ms", type=float, help="drafting time per token, ms")
    speed.add_argument("--draft-steps", type=float, help="drafting time per token, plain steps")
    args = parser.parse_args(argv)

    a = args.acceptance
    print(f"one-slot verify, a = {a}, {args.context} tokens of context (a model, not a run)")
    print(
        "| regime | plain tok/s | one-slot round ms (k = 1 / 3 / 7) | ideal tok/s (k) "
        "| x plain | overlap tok/s (k) | x plain | x llama.cpp drafting |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name in args.regimes:
        regime = load_regime(name)
        step = regime.step_ms(args.context)
        plain = 1e3 / step
        draft_ms = args.draft_ms if args.draft_ms is not None else args.draft_steps * step
        rounds = {k: one_slot_round_ms(regime, k, args.context) for k in range(1, args.max_k + 1)}
        ideal = ideal_ceiling(a, rounds)
        overlap = overlap_ceiling(a, rounds, draft_ms, resync_ms=draft_ms)
        assert ideal is not None and overlap is not None
        builtin = regime.reference.get("llama_cpp_drafting_tok_s")
        versus = f"{overlap.tokens_per_s / builtin:.2f}" if builtin else "-"
        shown = " / ".join(f"{rounds[k]:.1f}" for k in (1, 3, 7) if k in rounds)
        print(
            f"| {regime.name} | {plain:.1f} | {shown} "
            f"| {ideal.tokens_per_s:.1f} ({ideal.k}) | {ideal.tokens_per_s / plain:.2f} "
            f"| {overlap.tokens_per_s:.1f} ({overlap.k}) | {overlap.tokens_per_s / plain:.2f} "
            f"| {versus} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
