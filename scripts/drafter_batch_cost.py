"""What one draft step costs for B sequences at once, on an ONNX drafter folder.

Drafting the likeliest outcomes of a pending verify round (the all-accepted line and
the lines after its likeliest rejection points) only pays where a step for a few
sequences costs about what a step for one costs. This times one decode step (one new
token per sequence, a context of L cached positions) for batches of B sequences,
through the same shared-buffer KV binding the `onnx` backend uses (the cached
positions are zeros: the time does not depend on their values).

    python scripts/drafter_batch_cost.py DRAFTER_DIR --batches 1,2,4 --contexts 512,4096
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from npu_draft import providers


def time_step(session: ort.InferenceSession, batch: int, context: int, repeats: int) -> float:
    """Median ms of one decode step for `batch` sequences after `context` positions."""
    inputs = {i.name: i for i in session.get_inputs()}
    binding = session.io_binding()
    for name, meta in inputs.items():
        if not name.startswith("past_key_values."):
            continue
        _, kv_heads, _, head_dim = meta.shape
        buffer = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch, kv_heads, context + 1, head_dim), np.float32)
        )
        binding.bind_ortvalue_input(name, buffer)
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffer)
    binding.bind_cpu_input("input_ids", np.ones((batch, 1), np.int64))
    binding.bind_cpu_input("attention_mask", np.ones((batch, context + 1), np.int64))
    if "position_ids" in inputs:
        binding.bind_cpu_input("position_ids", np.full((batch, 1), context, np.int64))
    binding.bind_output("logits", "cpu")
    session.run_with_iobinding(binding)  # warm-up: allocations, kernel choice
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append((time.perf_counter() - started) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", type=Path, help="an ONNX drafter folder (model.onnx)")
    parser.add_argument("--batches", default="1,2,4", help="comma list of B")
    parser.add_argument("--contexts", default="512", help="comma list of cached positions L")
    parser.add_argument("--provider", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    options = ort.SessionOptions()
    if args.threads:
        options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(
        str(args.drafter / "model.onnx"), options, providers=[providers.ORT_NAMES[args.provider]]
    )
    rows = []
    print(f"{'L':>6} {'B':>3} {'ms/step':>9} {'x B=1':>7} {'ms/sequence':>12}")
    for context in (int(c) for c in args.contexts.split(",")):
        single = None
        for batch in (int(b) for b in args.batches.split(",")):
            ms = time_step(session, batch, context, args.repeats)
            single = single if single is not None else ms
            rows.append({"context": context, "batch": batch, "ms_per_step": ms})
            print(f"{context:>6} {batch:>3} {ms:>9.1f} {ms / single:>7.2f} {ms / batch:>12.1f}")
    if args.output:
        args.output.write_text(json.dumps({"drafter": str(args.drafter), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
