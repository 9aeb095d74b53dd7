#!/usr/bin/env python
"""Where a drafter's time goes, node by node: ONNX Runtime's profiler around the
product's own runner (`npu_draft.onnx_runner`, the `onnx` backend).

On an H100 (stage `s32a`) the 0.6B-shape fp16 drafter on CUDA stepped in 2.9 ms, yet
each request's first draft waited 2.2-3.5 s for its 513-token prompt. This script
showed the prompt taking 7.6 ms on a warm thread: the wait was each request's new
thread (`npu_draft.async_session`). It times, on one thread, one model:

- two prefills of `--length` tokens into fresh sessions (the first warms up);
- `--steps` single-token draft steps after the second;

then reads the profile and prints, for the second prefill and for the steps, the wall
time, the nodes' own time by execution provider and operator, and which provider ran
each operator (a node that fell back to the CPU shows there).

    python scripts/drafter_profile.py DRAFTER_DIR --provider cuda --length 512 -o out.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from npu_draft.onnx_runner import OnnxDraftModel

TOP = 12  # operators listed per phase


def node_times(profile: list[dict]) -> tuple[list[tuple[int, int]], list[dict]]:
    """The runs' (start, end) in µs, in order, and the nodes' kernel events."""
    runs = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in profile
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    nodes = [
        e for e in profile if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
    ]
    return runs, nodes


def summarize(runs: list[tuple[int, int]], nodes: list[dict]) -> dict:
    """Node time (ms) in these runs by provider and by (provider, operator)."""
    by_provider: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for node in nodes:
        if not any(start <= node["ts"] < end for start, end in runs):
            continue
        args = node.get("args", {})
        provider = str(args.get("provider", "?")).replace("ExecutionProvider", "")
        ms = node["dur"] / 1e3
        by_provider[provider] += ms
        by_op[f"{provider} {args.get('op_name', '?')}"] += ms
    top = sorted(by_op.items(), key=lambda item: -item[1])[:TOP]
    return {
        "runs": len(runs),
        "run_ms": round(sum(end - start for start, end in runs) / 1e3, 2),
        "node_ms_by_provider": {k: round(v, 2) for k, v in by_provider.items()},
        "top_ops_ms": {k: round(v, 2) for k, v in top},
    }


def placement(nodes: list[dict]) -> dict[str, list[str]]:
    """Operator -> the providers that ran it."""
    seen: dict[str, set[str]] = defaultdict(set)
    for node in nodes:
        args = node.get("args", {})
        seen[str(args.get("op_name", "?"))].add(str(args.get("provider", "?")))
    return {op: sorted(p) for op, p in sorted(seen.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", type=Path, help="a drafter folder (export-drafter's)")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--prefill-chunk", type=int, default=None, help="tokens a run while taking a prompt in"
    )
    parser.add_argument(
        "--no-cross-check", action="store_true", help="skip the start-up CPU comparison"
    )  # random weights: near-ties flip between providers
    parser.add_argument("-o", "--output", type=Path, help="write the summary as JSON")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="drafter-profile-") as tmp:
        model = OnnxDraftModel(
            args.drafter,
            args.provider,
            max_context=args.length + args.steps + 8,
            prefill_chunk=args.prefill_chunk,
            profile_prefix=str(Path(tmp) / "ort"),
            cross_check=False if args.no_cross_check else None,
        )
        provider = model.choice.name
        chunk = model.prefill_chunk
        vocab = model.info.vocab_size or 151_936
        prompt = np.random.default_rng(0).integers(0, min(vocab, 151_000), args.length).tolist()
        walls = {}
        for phase in ("warm-up", "prefill"):
            session = model.open_session()
            started = time.perf_counter()
            session.sync(prompt)
            walls[phase] = (time.perf_counter() - started) * 1e3
            if phase == "prefill":
                session.propose(1)  # the logits are there: no run
                started = time.perf_counter()
                for _ in range(args.steps):
                    session.propose(1)
                walls["steps"] = (time.perf_counter() - started) * 1e3
            session.close()
        model.close()
        assert model.profile_path is not None
        profile = json.loads(model.profile_path.read_text())

    runs, nodes = node_times(profile)
    per_prefill = math.ceil(args.length / chunk)
    phases = {
        "prefill": runs[per_prefill : 2 * per_prefill],
        "steps": runs[2 * per_prefill : 2 * per_prefill + args.steps],
    }
    result = {
        "drafter": str(args.drafter),
        "provider": provider,
        "length": args.length,
        "prefill_chunk": chunk,
        "wall_ms": {k: round(v, 2) for k, v in walls.items()},
        "prefill": summarize(phases["prefill"], nodes),
        "steps": summarize(phases["steps"], nodes),
        "placement": placement(nodes),
    }
    print(f"drafter {args.drafter} on {provider}; {args.length} tokens in runs of {chunk}")
    step_ms = walls["steps"] / args.steps
    print(f"wall ms: warm-up prefill {walls['warm-up']:.1f}, prefill {walls['prefill']:.1f}, "
          f"{args.steps} steps {walls['steps']:.1f} ({step_ms:.2f} a step)")  # fmt: skip
    for phase in ("prefill", "steps"):
        part = result[phase]
        print(f"{phase}: {part['runs']} runs, {part['run_ms']} ms in runs; "
              f"node ms by provider {part['node_ms_by_provider']}")  # fmt: skip
        for op, ms in part["top_ops_ms"].items():
            print(f"  {ms:10.2f}  {op}")
    off = {op: p for op, p in result["placement"].items() if "CPUExecutionProvider" in p}
    if provider != "cpu":
        print(f"operators run on the CPU provider: {off or 'none'}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
