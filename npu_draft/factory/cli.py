"""`npu-spec make-models OUT`: write the offline model set."""

from __future__ import annotations

import argparse
from pathlib import Path

from npu_draft.factory.make import make_models
from npu_draft.factory.shapes import DRAFT_SHAPES, TARGET_SHAPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--draft",
        default="same",
        help="draft variant: same (acceptance ~1), noisy[:sigma] (noise of sigma x each "
        "tensor's std; default 0.05), unrelated (acceptance ~0)",
    )
    parser.add_argument(
        "--target-shape",
        default="small",
        choices=sorted(TARGET_SHAPES),
        help="small: the core itself; qwen3-*: cost-padded target computing the core function",
    )
    parser.add_argument(
        "--target-dtype",
        choices=["float32", "float16", "q8_0", "q4_0"],
        default=None,
        help="target GGUF weight type (default: float16 for qwen3-* shapes, else float32). "
        "q8_0 writes GGML Q8_0 as llama-quantize does (every 2-D weight, embeddings and "
        "output head included; norms stay float32), about half the float16 size (qwen3-32b: "
        "35 GB instead of 66 GB), for benchmarks. Not exact: the core weights are quantized, "
        "so a q8_0 target computes the float32 core function (target-hf, core.gguf, the "
        "float targets) only nearly: on padded-test its greedy next token matched the float "
        "one at ~95%% of positions (teacher-forced), free-running continuations part after "
        "2-15 tokens, and drafts made from the float core are accepted less often. "
        "q4_0 writes GGML Q4_0 as llama-quantize does (norms float32), except the output "
        "head, which is Q8_0 (llama-quantize makes it Q6_K, which this writer cannot): about "
        "0.29x the float16 size; much further from the core function than q8_0 (~40%% "
        "teacher-forced agreement with it). With q8_0 or q4_0, drafts (--draft) are made "
        "from the core as the target stores it (quantized, dequantized), so `same` is nearly the "
        "target's own function again and noise levels mean what they mean for float targets",
    )
    parser.add_argument(
        "--draft-shape",
        choices=sorted(DRAFT_SHAPES),
        default=None,
        help="pad the draft like the target: it computes exactly the core draft function "
        "(--draft) but costs what the named model costs. Default: qwen3-0.6b for the qwen3-* "
        "target shapes, core for small and padded-test. Applies to draft.gguf and draft/ "
        "(exported from a temporary padded Hugging Face folder; draft-hf/ stays the core "
        "draft function, draft-core.gguf holds it as float32 GGUF). The padded draft keeps a "
        "separate output head (the real 0.6B and 1.7B tie it to the embeddings): same cost "
        "per token, a larger file",
    )
    parser.add_argument(
        "--draft-dtype",
        choices=["float32", "float16", "q8_0"],
        default=None,
        help="draft.gguf weight type (default: q8_0 for the qwen3-* draft shapes, as users "
        "run a 0.6B draft, else float32). With q8_0, draft-hf/, draft-core.gguf and draft/ "
        "(float32 ONNX) hold the draft's weights as draft.gguf stores them (dequantized), so "
        "the proxy's drafter drafts what llama.cpp's drafting does (nearly: llama.cpp also "
        "rounds activations)",
    )
    parser.add_argument(
        "--eos-boost",
        type=float,
        default=0.0,
        help="scale the <|im_end|> output row (e.g. 2.5) so generations end by EOS",
    )
    parser.add_argument(
        "--no-drafter", action="store_true", help="skip exporting the ONNX drafter folder"
    )


def run(args: argparse.Namespace) -> int:
    out = make_models(
        args.out,
        seed=args.seed,
        draft=args.draft,
        target_shape=args.target_shape,
        target_dtype=args.target_dtype,
        with_drafter=not args.no_drafter,
        eos_boost=args.eos_boost,
        draft_shape=args.draft_shape,
        draft_dtype=args.draft_dtype,
    )
    print(out)
    return 0
