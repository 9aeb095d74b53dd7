#!/usr/bin/env python
"""Draft latency and re-sync cost versus context length, per drafter backend.

For each backend and context length L it measures, on the machine it runs on:

- prefill: sync of L tokens into an empty session (a conversation's first round);
- per-token draft latency: propose(k) after a sync at L, divided by k;
- re-sync after a round, for the outcomes a verifier returns: 2 of k accepted plus
  the correction (a rollback of k-2 drafted tokens), and all k accepted plus the
  bonus token.

Prints a Markdown table (median of --repeats runs). Not a test: numbers depend on
the machine and on what else runs.

    python scripts/bench_drafter.py                       # factory draft model
    python scripts/bench_drafter.py --drafter DIR --backends onnx,genai --provider cuda
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from npu_draft.load import load_drafter
from npu_draft.protocol import DraftModel

DEFAULT_CONTEXTS = "128,256,512,1024,2048,4096"


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def bench_one(model: DraftModel, length: int, k: int, repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = model.info.vocab_size or 151_936
    # Random ids, except a repeated stretch so the n-gram drafter has something to find.
    base = rng.integers(0, min(vocab, 151_000), length).tolist()
    base[-16:] = base[length // 2 : length // 2 + 16]
    prefill, per_token, partial, full = [], [], [], []
    for _ in range(repeats):
        session = model.open_session()
        start = time.perf_counter()
        session.sync(base)
        prefill.append(ms_since(start))
        session.propose(k)  # warm-up round at this length
        session.sync(base)

        start = time.perf_counter()
        drafted = session.propose(k).tokens
        per_token.append(ms_since(start) / k)

        reject = drafted[2] + 1 if len(drafted) > 2 else 1
        start = time.perf_counter()
        session.sync([*base, *drafted[:2], reject])
        partial.append(ms_since(start))

        session.sync(base)
        session.propose(k)
        start = time.perf_counter()
        session.sync([*base, *drafted, 7])
        full.append(ms_since(start))
        session.close()
    return {
        "prefill": statistics.median(prefill),
        "per_token": statistics.median(per_token),
        "resync_partial": statistics.median(partial),
        "resync_full": statistics.median(full),
    }


def ensure_drafter(path: str | None) -> Path:
    if path:
        return Path(path)
    from npu_draft.factory import make_models

    out = Path(tempfile.gettempdir()) / "npu-spec-bench-models"
    if not (out / "draft" / "genai_config.json").is_file():
        print(f"making factory models in {out} ...", file=sys.stderr)
        make_models(out, seed=0, draft="same")
    return out / "draft"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", help="drafter folder (default: the factory's draft model)")
    parser.add_argument("--backends", default="onnx,genai,ngram")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS)
    parser.add_argument("--k", type=int, default=8, help="tokens per draft")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-context", type=int, default=4096)
    args = parser.parse_args()

    folder = ensure_drafter(args.drafter)
    rows = []
    for backend in args.backends.split(","):
        spec = "ngram" if backend == "ngram" else folder
        model = load_drafter(
            spec,
            args.provider,
            **({} if backend == "ngram" else {"backend": backend, "max_context": args.max_context}),
        )
        limit = model.info.max_context - args.k - 2
        bench_one(model, 64, args.k, 1, seed=0)  # first-call costs: arenas, thread pools
        for length in (int(x) for x in args.contexts.split(",")):
            length = min(length, limit)
            result = bench_one(model, length, args.k, args.repeats, seed=length)
            rows.append((backend, model.info.provider, length, result))
            print(f"{backend} L={length}: {result}", file=sys.stderr)
        model.close()

    print(f"Command: `python scripts/bench_drafter.py {shlex.join(sys.argv[1:])}`".rstrip())
    print(f"Drafter: {folder}, k = {args.k}, median of {args.repeats}")
    print()
    print(
        "| backend | provider | context | prefill ms | draft ms/token "
        "| re-sync 2/k + correction ms | re-sync k/k + bonus ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for backend, provider, length, r in rows:
        print(
            f"| {backend} | {provider} | {length} | {r['prefill']:.1f} | {r['per_token']:.2f} "
            f"| {r['resync_partial']:.2f} | {r['resync_full']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
