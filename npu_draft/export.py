"""`npu-spec export-drafter HF_DIR OUT`: a drafter folder from a local Hugging Face checkpoint.

The graph comes from onnxruntime-genai's own model builder
(`python -m onnxruntime_genai.models.builder`), the tool that makes the GenAI folders
AMD's Ryzen AI runtime consumes, so an exported folder is the same kind of artefact
as a vendor NPU model: decoder layers with GroupQueryAttention and a shared
past/present KV buffer, which both backends use as is. It runs offline on a local
folder and is deterministic (same input, same bytes).

`--format genai` keeps genai_config.json (backend `genai`, or `onnx` when asked);
`--format onnx` drops it and records the decoder's shapes in `npu_draft.json`, so the
folder loads as a plain ONNX decoder. Either way `npu_draft.json` records the
tokenizer the drafter expects (see npu_draft.tokenizer_check).

The builder needs PyTorch, onnx-ir and transformers (the `export` extra). Without
them an fp32 export of a Qwen3 checkpoint writes the same graph with
`npu_draft.onnx_writer`; int4 needs the builder. Running a drafter needs none of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npu_draft.drafter_folder import FORMATS, ExportError, finish_drafter_folder
from npu_draft.ort_backend import DEFAULT_MAX_CONTEXT

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int4")


def export_drafter(
    hf_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "genai",
    precision: str = "fp32",
    max_context: int = DEFAULT_MAX_CONTEXT,
    overwrite: bool = True,
    last_position_logits: bool = True,
) -> Path:
    """Write a drafter folder for the checkpoint in `hf_dir` to `out_dir` and return it.

    The folder appears whole or not at all (built next to it, then renamed).
    `last_position_logits` keeps the output head to the last input position (see
    `keep_last_position_logits`); False leaves the builder's graph untouched.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    if not (hf_dir / "config.json").is_file():
        raise ExportError(f"{hf_dir} is not a Hugging Face checkpoint folder (no config.json)")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty (use --force to replace it)")
    # fp16 (for CUDA) always from the writer: the builder's fp32 graph op for op, in half
    # precision, so both precisions run on the same backends
    writer = precision == "fp16" or (precision == "fp32" and _missing_builder_dependencies())
    if writer and last_position_logits:
        from npu_draft.onnx_writer import write_drafter  # the same graph, without PyTorch

        log.info("writing the %s graph with npu_draft.onnx_writer", precision)
        return write_drafter(hf_dir, out_dir, fmt=fmt, max_context=max_context, precision=precision)
    _require_builder_dependencies()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as tmp:
        staging = Path(tmp) / "drafter"
        _run_builder(hf_dir, staging, precision, Path(tmp) / "builder-cache")
        if last_position_logits:
            keep_last_position_logits(staging / "model.onnx")
        finish_drafter_folder(hf_dir, staging, fmt, precision, max_context)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    log.info("drafter (%s, %s) written to %s", fmt, precision, out_dir)
    return out_dir


def _missing_builder_dependencies() -> list[str]:
    return [m for m in ("torch", "onnx_ir", "transformers") if importlib.util.find_spec(m) is None]


def _require_builder_dependencies() -> None:
    missing = _missing_builder_dependencies()
    if missing:
        raise ExportError(
            f"this export needs {', '.join(missing)} for onnxruntime-genai's model builder "
            f"(install with `pip install 'npu-spec[export]'`; fp32 exports of Qwen3 need none)"
        )


def _run_builder(hf_dir: Path, out: Path, precision: str, cache: Path) -> None:
    # The builder is run as its documented command: its module imports siblings by
    # top-level name and is not meant to be imported as a library.
    command = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "--input", str(hf_dir),
        "--output", str(out),
        "--precision", precision,
        "--execution_provider", "cpu",
        "--cache_dir", str(cache),
    ]  # fmt: skip
    log.info("exporting %s with the onnxruntime-genai model builder (%s)", hf_dir, precision)
    # The builder stamps `git rev-parse HEAD` of whatever checkout its venv lives in into
    # producer_version; hiding git keeps the export byte-for-byte repeatable.
    env = {**os.environ, "GIT_DIR": os.devnull}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    log.debug("builder output:\n%s%s", done.stdout, done.stderr)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise ExportError(
            f"the onnxruntime-genai model builder failed on {hf_dir} "
            f"(exit {done.returncode}):\n" + "\n".join(tail)
        )


def keep_last_position_logits(model_path: Path) -> None:
    """Apply the output head to the last input position only.

    A drafter only ever reads the logits after the last token, but the builder's
    graph computes them for every input position: with a 152k vocabulary the head
    then dominates prefill and multi-token re-sync (4k positions would also make a
    2.5 GB logits tensor). A Slice in front of the head makes `logits` [batch, 1,
    vocab]; both backends read that unchanged (measured: 300-token prefill of the
    factory model 6-7x faster, identical logits). Only the graph file is rewritten;
    the weights stay in their external data file.
    """
    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    head = producer.get("logits")
    while head is not None and head.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
        head = producer.get(head.input[0])  # past a Cast or Reshape after the head
    if head is None:
        raise ExportError(f"{model_path}: no MatMul produces `logits`; cannot trim the head")
    last_hidden = "/lm_head/last_position/output_0"
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([-1], np.int64), "/lm_head/last_position/starts"),
            numpy_helper.from_array(np.array([2**62], np.int64), "/lm_head/last_position/ends"),
            numpy_helper.from_array(np.array([1], np.int64), "/lm_head/last_position/axes"),
        ]
    )
    trim = helper.make_node(
        "Slice",
        [
            head.input[0],
            "/lm_head/last_position/starts",
            "/lm_head/last_position/ends",
            "/lm_head/last_position/axes",
        ],
        [last_hidden],
        name="/lm_head/last_position",
    )
    head.input[0] = last_hidden
    graph.node.insert(list(graph.node).index(head), trim)
    for output in graph.output:
        if output.name == "logits":
            positions = output.type.tensor_type.shape.dim[1]
            positions.Clear()
            positions.dim_value = 1
    onnx.save(model, str(model_path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", type=Path, help="local Hugging Face checkpoint (Qwen3 family)")
    parser.add_argument("out", type=Path, help="drafter folder to write")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="genai",
        help="genai: ONNX Runtime GenAI folder (runs on both backends); onnx: plain decoder",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="weights: fp32; fp16 for the cuda provider (its attention kernel takes no "
        "fp32: an fp32 drafter runs attention on the CPU there); or int4 (smaller and "
        "faster, a little less accurate)",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        help="longest sequence the drafter holds (KV buffers are sized for it)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--all-position-logits",
        action="store_true",
        help="keep the builder's graph as is (logits for every input position)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        out = export_drafter(
            args.hf_dir,
            args.out,
            fmt=args.format,
            precision=args.precision,
            max_context=args.max_context,
            overwrite=args.force,
            last_position_logits=not args.all_position_logits,
        )
    except (ExportError, ValueError) as error:
        print(f"npu-spec export-drafter: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0
