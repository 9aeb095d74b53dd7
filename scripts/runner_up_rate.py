"""How often the draft's runner-up is the target's token where its first choice is not
(issue 29, item 3b).

Multi-outcome drafting prepares, besides the all-accepted line, the line that starts at
the draft's runner-up after j accepted drafts. That pays in proportion to how often the
target, having rejected the draft's top-1 at a position, chose the draft's 2nd choice.

The target's greedy continuations of the benchmark prompts (benchmarks/prompts.json,
the long one at its own length) come from a stock llama-server running the target GGUF. The
drafter then reads each continuation teacher-forced (its context is the prompt plus the
target's tokens so far, as it is after j accepted drafts) and ranks its logits at every
position: a position where its top-1 differs from the target's token is a rejection;
counted there is whether the target's token is the draft's 2nd choice, or among its top 3.

    python scripts/runner_up_rate.py MODEL_SET -n 64 -o out.json

MODEL_SET is a `npu-spec make-models` folder (target.gguf, draft/), or give --target
and --drafter. With the factory's models the rate measures that test pair (a
random-weight target and its noisy copy), not Qwen3-0.6B against Qwen3-32B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from npu_draft import providers
from npu_draft.onnx_runner import OnnxDraftModel
from proxy.bench.client import exact_tokens
from proxy.bench.prompts import ServerText, build_prompts, load_prompt_set
from proxy.server.llama_server import LlamaServerProcess, find_llama_server

FACTORY_NOTE = (
    "factory models: a random-weight target and a noisy copy of it as the draft. The rates "
    "measure this test pair, not Qwen3-0.6B against Qwen3-32B (or any trained pair)."
)


async def target_continuations(
    target: Path, n_predict: int, threads: int, log: Path
) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt tokens, the target's greedy continuation) per prompt."""
    args = ["-c", "4096", "-np", "1", "-t", str(threads)]
    server = LlamaServerProcess(find_llama_server(), target, args, log_path=log)
    async with server, aiohttp.ClientSession() as session:
        prompts = await build_prompts(ServerText(session, server.base_url), load_prompt_set(), None)
        out = []
        for prompt in prompts:
            continuation = await exact_tokens(session, server.base_url, prompt.tokens, n_predict)
            out.append((prompt.id, list(prompt.tokens), continuation))
        return out


def draft_ranks(model: OnnxDraftModel, prompt: list[int], continuation: list[int]) -> list[dict]:
    """At every position of the continuation: the target's token, the draft's top 3 and
    their probabilities (teacher-forced)."""
    session = model.open_session()
    rows = []
    try:
        for j, token in enumerate(continuation):
            session.sync(prompt + continuation[:j])
            logits = session.next_logits().astype(np.float64)
            top = np.argsort(logits)[::-1][:3]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            rows.append({"target": int(token), "top": [int(t) for t in top],
                         "p": [round(float(probs[t]), 5) for t in top]})  # fmt: skip
    finally:
        session.close()
    return rows


def summary(rows: list[dict]) -> dict:
    rejected = [r for r in rows if r["top"][0] != r["target"]]
    runner_up = [r for r in rejected if r["top"][1] == r["target"]]
    top3 = [r for r in rejected if r["target"] in r["top"][1:3]]
    n, m = len(rows), len(rejected)
    return {
        "positions": n,
        "top1_agreement": round((n - m) / n, 4) if n else None,
        "rejections": m,
        "runner_up_hits": len(runner_up),
        "runner_up_hit_rate": round(len(runner_up) / m, 4) if m else None,
        "top3_hit_rate": round(len(top3) / m, 4) if m else None,
        "mean_runner_up_p_at_rejections": (
            round(float(np.mean([r["p"][1] for r in rejected])), 4) if m else None
        ),
        "mean_top1_p_at_rejections": (
            round(float(np.mean([r["p"][0] for r in rejected])), 4) if m else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_set", type=Path, nargs="?", help="a make-models folder")
    parser.add_argument("--target", type=Path, help="target GGUF (default MODEL_SET/target.gguf)")
    parser.add_argument(
        "--drafter", type=Path, help="ONNX drafter folder (default MODEL_SET/draft)"
    )
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--threads", type=int, default=0, help="0: the cores this process may use")
    parser.add_argument("-o", "--output", type=Path, help="write the summary and rows as JSON")
    args = parser.parse_args()
    if args.model_set is None and (args.target is None or args.drafter is None):
        parser.error("give MODEL_SET, or both --target and --drafter")
    target = args.target or args.model_set / "target.gguf"
    drafter = args.drafter or args.model_set / "draft"
    threads = args.threads or providers.default_threads()
    manifest_path = args.model_set / "manifest.json" if args.model_set else None
    manifest = (
        json.loads(manifest_path.read_text()) if manifest_path and manifest_path.exists() else None
    )

    started = time.perf_counter()
    log = Path(tempfile.gettempdir()) / f"runner_up_rate-{os.getpid()}.server.log"
    references = asyncio.run(target_continuations(target, args.n_predict, threads, log))
    print(f"target continuations: {len(references)} prompts, {time.perf_counter() - started:.0f} s")
    per_prompt, every = {}, []
    model = OnnxDraftModel(drafter, "cpu", threads=threads, cross_check=False)
    for prompt_id, prompt, continuation in references:
        rows = draft_ranks(model, prompt, continuation)
        per_prompt[prompt_id] = summary(rows)
        every.extend(rows)
        print(f"  {prompt_id:<14} {per_prompt[prompt_id]}")
    total = summary(every)
    note = FACTORY_NOTE if manifest is not None else "the pair named above"
    print(f"all: {total}\n{note}")
    if args.output:
        result = {
            "target": str(target), "drafter": str(drafter), "manifest": manifest,
            "note": note, "n_predict": args.n_predict, "summary": total,
            "per_prompt": per_prompt, "rows": every,
        }  # fmt: skip
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
