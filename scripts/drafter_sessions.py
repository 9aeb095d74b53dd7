#!/usr/bin/env python
"""The proxy's drafter path request by request: what each request's first draft waits.

Each request opens a draft session, takes in a prompt of `--length` tokens, drafts `k`
tokens and closes, as the engine does through `npu_draft.async_session`. Two ways of
running the sessions, side by side on one loaded model:

- `pooled`: `AsyncDraftSession`, whose worker threads outlive the sessions (the product);
- `fresh`: a new one-thread executor per session, shut down at close (the proxy before
  the pool). ONNX Runtime's CUDA provider sets up cuBLAS/cuDNN handles per thread, so on
  CUDA every fresh session pays that set-up again.

The model is warmed up first on a pooled worker, as `proxy serve` does. Prints, per way,
the median and the worst prompt intake and per-token draft time over the requests.
`--graphs off,on` loads the model once per setting, one after the other, to compare
draft steps with and without CUDA graphs (`npu_draft.decode_graph`).

    python scripts/drafter_sessions.py DRAFTER_DIR --provider cuda --length 512 -o out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from npu_draft.async_session import AsyncDraftSession, run_on_worker
from npu_draft.onnx_runner import OnnxDraftModel
from npu_draft.protocol import DraftModel
from npu_draft.warmup import warm_up


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


async def timed(call: Callable, prompt: list[int], k: int) -> tuple[float, float]:
    """(prompt intake ms, draft ms a token) of one request; `call(fn)` runs `fn(session)`
    on the way's thread."""
    start = time.perf_counter()
    await call(lambda session: session.sync(prompt))
    intake = ms_since(start)
    start = time.perf_counter()
    draft = await call(lambda session: session.propose(k))
    return intake, ms_since(start) / len(draft)


async def pooled_request(model: DraftModel, prompt: list[int], k: int) -> tuple[float, float]:
    session = AsyncDraftSession(model.open_session())
    try:
        return await timed(session.call, prompt, k)
    finally:
        await session.close()


async def fresh_request(model: DraftModel, prompt: list[int], k: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    session = model.open_session()
    thread = ThreadPoolExecutor(max_workers=1)
    try:
        return await timed(lambda fn: loop.run_in_executor(thread, fn, session), prompt, k)
    finally:
        await loop.run_in_executor(thread, session.close)
        thread.shutdown(wait=True)


REQUESTS = {"pooled": pooled_request, "fresh": fresh_request}
GRAPH_SETTINGS = {"default": None, "on": True, "off": False}


async def measure(model: DraftModel, ways: list[str], requests: int, length: int, k: int) -> dict:
    rng = np.random.default_rng(0)
    vocab = model.info.vocab_size
    results: dict[str, dict] = {}
    for way in ways:
        rows = []
        for _ in range(requests):  # a new prompt each time: no request reuses a cache
            prompt = rng.integers(0, vocab, size=length).tolist()
            rows.append(await REQUESTS[way](model, prompt, k))
        intakes, steps = zip(*rows, strict=True)
        results[way] = {
            "intake_ms": [round(v, 2) for v in intakes],
            "step_ms": [round(v, 2) for v in steps],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", type=Path, help="a drafter folder (export-drafter's)")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("-k", type=int, default=6, help="tokens drafted per request")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--ways", default="pooled,fresh", help=f"of {','.join(REQUESTS)}")
    parser.add_argument(
        "--no-cross-check",
        action="store_true",
        help="skip the start-up comparison with the CPU (random weights flip near-ties)",
    )
    parser.add_argument(
        "--graphs",
        default="default",
        help="CUDA graph steps: default (the runner's choice), on, off, or several (off,on)",
    )
    parser.add_argument("-o", "--output", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(REQUESTS))
    if unknown:
        parser.error(f"unknown --ways {unknown}; choose from {sorted(REQUESTS)}")
    settings = args.graphs.split(",")
    if not set(settings) <= set(GRAPH_SETTINGS):
        parser.error(f"--graphs takes {', '.join(GRAPH_SETTINGS)}")

    results: dict[str, dict] = {}
    warm_ms: dict[str, float] = {}
    graphs: dict[str, bool] = {}
    for setting in settings:
        model = OnnxDraftModel(
            args.drafter,
            args.provider,
            cross_check=False if args.no_cross_check else None,
            cuda_graphs=GRAPH_SETTINGS[setting],
        )
        if args.length + args.k > model.max_context:  # a full context drafts nothing
            parser.error(f"--length {args.length} + k {args.k} > the context ({model.max_context})")
        warm_ms[setting] = run_on_worker(lambda: warm_up(model))  # noqa: B023  # waited for
        graphs[setting] = model.graphs
        measured = asyncio.run(measure(model, ways, args.requests, args.length, args.k))
        model.close()
        for way, got in measured.items():
            results[way if len(settings) == 1 else f"{way}, graphs {setting}"] = got

    print(f"drafter {args.drafter} on {model.info.provider}; warm-up ms {warm_ms}")
    print(f"graph steps in use: {graphs}")
    print(f"{args.requests} requests, {args.length}-token prompts, k = {args.k}\n")
    print("| way | intake ms, median | intake ms, worst | draft ms a token, median | worst |")
    print("|---|---:|---:|---:|---:|")
    for way, got in results.items():
        intake, step = got["intake_ms"], got["step_ms"]
        print(
            f"| {way} | {statistics.median(intake):.1f} | {max(intake):.1f} "
            f"| {statistics.median(step):.2f} | {max(step):.2f} |"
        )
    if args.output:
        summary = {
            "drafter": str(args.drafter),
            "provider": model.info.provider,
            "length": args.length,
            "k": args.k,
            "warm_up_ms": {setting: round(ms, 1) for setting, ms in warm_ms.items()},
            "graphs": graphs,
            "ways": results,
        }
        args.output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
