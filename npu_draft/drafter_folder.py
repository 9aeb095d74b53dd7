"""What every drafter folder ends with, whichever writer made its graph.

Both `npu_draft.export` (onnxruntime-genai's model builder) and
`npu_draft.onnx_writer` (the PyTorch-free writer) finish their folder here: the
context cap, the checkpoint's eos ids, its tokenizer files and npu_draft.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from npu_draft.onnx_runner import DecoderSpec
from npu_draft.tokenizer_check import DrafterManifest, facts_from_hf_folder

FORMATS = ("genai", "onnx")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ExportError(RuntimeError):
    pass


def finish_drafter_folder(
    hf_dir: Path, folder: Path, fmt: str, precision: str, max_context: int
) -> None:
    """Cap the context, record the checkpoint's eos ids, copy its tokenizer files and
    write npu_draft.json; `fmt` onnx drops genai_config.json."""
    genai_config_path = folder / "genai_config.json"
    genai_config = json.loads(genai_config_path.read_text())
    model = genai_config["model"]
    # The builder derives context_length from max_position_embeddings (40,960 for
    # Qwen3); GenAI allocates the shared KV buffer for max_length, and Ryzen AI NPU
    # models stop at 4k anyway.
    context = min(int(model.get("context_length", max_context)), max_context)
    model["context_length"] = context
    genai_config["search"]["max_length"] = context
    # The builder appends the tokenizer's eos token to the model's list; for a folder
    # without one it guesses id 0. The checkpoint's own config is what counts.
    facts = facts_from_hf_folder(hf_dir, name=_model_name(hf_dir))
    if facts.eos_token_ids:
        model["eos_token_id"] = list(facts.eos_token_ids)
    genai_config_path.write_text(json.dumps(genai_config, indent=4) + "\n")

    for name in _TOKENIZER_FILES:  # the checkpoint's exact tokenizer, not a re-save
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, folder / name)
    spec = DecoderSpec._from_genai_config(model)
    if fmt == "onnx":
        genai_config_path.unlink()
    DrafterManifest(
        tokenizer=facts,
        format=fmt,
        precision=precision,
        source=facts.name,
        decoder=spec.to_json(),
    ).write(folder)


def _model_name(hf_dir: Path) -> str:
    """The checkpoint's own name where it records one, else its folder name."""
    config = json.loads((hf_dir / "config.json").read_text())
    name = config.get("_name_or_path") or config.get("name_or_path")
    return str(name) if name else hf_dir.resolve().name
