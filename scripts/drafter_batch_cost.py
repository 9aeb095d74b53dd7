"""What one draft step costs for B sequences at once (issue 29, item 3a).

Drafting the likeliest outcomes of a pending verify round (the all-accepted line and
the lines after its likeliest rejection points) only pays where a step for a few
sequences costs about what a step for one costs. This times one decode step (one new
token per sequence after L cached positions) for batches of B sequences in ONE ONNX
Runtime run, through the same shared past/present KV binding the `onnx` backend uses
(`npu_draft.batch_step`; the cached values are zeros: the time does not depend on them).

Without a drafter folder it writes a random-weight drafter of the real Qwen3-0.6B shape
(1024 wide, 28 layers, 16 query / 8 KV heads, ffn 3072, vocabulary 151,936; fp32, or
fp16 with --dtype f16) with the project's own graph writer: no download, no tokenizer.
Before timing it checks that the graph takes B > 1 (a dynamic batch axis) and that each
row of a batch gets the logits it gets alone.

    python scripts/drafter_batch_cost.py --provider cpu --batches 1,2,4,8,16 -o out.json
    python scripts/drafter_batch_cost.py DRAFTER_DIR --contexts 512,4096 --provider cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from npu_draft import providers
from npu_draft.batch_step import BatchStep, batch_axis, random_drafter
from npu_draft.factory.shapes import DRAFT_SHAPES
from npu_draft.onnx_writer import MODEL_FILE

DEVICES = {"cpu": "cpu", "cuda": "cuda"}


def time_step(step: BatchStep, context: int, repeats: int) -> float:
    """Median ms of one decode step for every row after `context` cached positions."""
    step.step([1] * step.batch, [context] * step.batch)  # warm-up: allocations, kernels
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step.run_again()
        times.append((time.perf_counter() - started) * 1e3)
    return float(np.median(times))


def rows_match_single(
    session: ort.InferenceSession, batch: int, capacity: int, device: str
) -> float:
    """Largest |logit| difference, relative to the largest logit, between each row of one
    batched step (rows of different lengths and tokens) and the same row run alone."""
    lengths = [(7 * row) % (capacity - 1) for row in range(batch)]
    tokens = [100 + 37 * row for row in range(batch)]
    together = BatchStep(session, batch, capacity, device).step(tokens, lengths)
    worst = 0.0
    for row in range(batch):
        alone = BatchStep(session, 1, capacity, device).step([tokens[row]], [lengths[row]])[0]
        diff = float(np.abs(together[row] - alone).max() / np.abs(alone).max())
        worst = max(worst, diff) if np.isfinite(diff) else float("inf")  # NaN must not hide
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", type=Path, nargs="?", help="an ONNX drafter folder "
                        "(model.onnx); default: write a random-weight one of --shape")  # fmt: skip
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(DRAFT_SHAPES))
    parser.add_argument("--dtype", default="f32", choices=["f32", "f16"],
                        help="weights of the random-weight drafter")  # fmt: skip
    parser.add_argument("--keep", type=Path, help="write the random-weight drafter here "
                        "and reuse it when it is there (default: a temporary folder)")  # fmt: skip
    parser.add_argument("--batches", default="1,2,4,8,16", help="comma list of B")
    parser.add_argument("--contexts", default="512", help="comma list of cached positions L")
    parser.add_argument("--provider", default="cpu", choices=sorted(DEVICES))
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (0: the cores this process may use)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, help="write the table as JSON")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(contexts) + 1

    wanted = providers.ORT_NAMES[args.provider]
    if wanted not in ort.get_available_providers():
        raise SystemExit(
            f"{wanted} is not in this onnxruntime build ({ort.get_available_providers()}); "
            f"nothing measured"
        )
    with tempfile.TemporaryDirectory(prefix="batch-cost-") as tmp:
        if args.drafter is not None:
            model, what = args.drafter / MODEL_FILE, str(args.drafter)
        else:
            folder = args.keep or Path(tmp)
            model = folder / MODEL_FILE
            what = f"random-weight {args.shape} ({args.dtype})"
            if not model.exists():
                started = time.perf_counter()
                random_drafter(DRAFT_SHAPES[args.shape], folder, context=max(capacity, 4096),
                               float16=args.dtype == "f16")  # fmt: skip
                print(f"wrote {what} in {time.perf_counter() - started:.0f} s")
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads or providers.default_threads()
        options.log_severity_level = 3
        chosen = list(dict.fromkeys([wanted, providers.ORT_NAMES["cpu"]]))
        session = ort.InferenceSession(str(model), options, providers=chosen)
        if wanted not in session.get_providers():
            raise SystemExit(f"{wanted} did not take the session: {session.get_providers()}")
        fixed = batch_axis(session)
        if fixed is not None:
            print(f"the graph's batch axis is fixed at {fixed}: only B = {fixed} can run")
            batches = [fixed]
        device = DEVICES[args.provider]
        check = rows_match_single(session, max(batches), capacity, device)
        print(f"drafter: {what}; provider {session.get_providers()[0]}, "
              f"{options.intra_op_num_threads} threads, {os.cpu_count()} CPUs; batch axis "
              f"{'dynamic' if fixed is None else fixed}; B = {max(batches)} rows vs alone: "
              f"max relative logit difference {check:.1e}")  # fmt: skip
        rows = []
        print(f"{'L':>6} {'B':>3} {'ms/step':>9} {'ms/sequence':>12} {'x B=1':>7}")
        for context in contexts:
            single = None
            for batch in batches:
                ms = time_step(BatchStep(session, batch, capacity, device), context, args.repeats)
                single = single if single is not None else ms
                rows.append({"context": context, "batch": batch, "ms_per_step": round(ms, 3),
                             "ms_per_sequence": round(ms / batch, 3),
                             "ratio_to_first": round(ms / single, 3)})  # fmt: skip
                print(f"{context:>6} {batch:>3} {ms:>9.1f} {ms / batch:>12.1f} {ms / single:>7.2f}")
    if args.output:
        result = {
            "drafter": what, "provider": session.get_providers()[0],
            "threads": options.intra_op_num_threads, "cpu_count": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "onnxruntime": ort.__version__, "batch_axis": "dynamic" if fixed is None else fixed,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "rows_vs_alone_max_rel_diff": check, "repeats": args.repeats, "rows": rows,
        }  # fmt: skip
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
