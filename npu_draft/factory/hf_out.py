"""Write Hugging Face Qwen3ForCausalLM folders (config, safetensors, tokenizer).

These folders are the universal source: transformers loads them as the reference
implementation, and the drafter export reads them.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from npu_draft.factory.gguf_out import (
    BOS_TOKEN_ID,
    CONTEXT_LENGTH,
    EOS_TOKEN_ID,
    RMS_EPS,
    ROPE_THETA,
)
from npu_draft.factory.shapes import ModelShape
from npu_draft.factory.weights import TensorSpec, Weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hf_config(shape: ModelShape) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.layers,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }


def build_tokenizer_files(vocab_gguf: Path, chat_template: str, out: Path) -> None:
    """Convert llama.cpp's Qwen2 vocab GGUF into tokenizer.json & co (offline, no PyTorch:
    transformers' GGUF reader imports it). The fields read on the way are kept beside
    them in gguf-tokenizer-fields.json, the cache `make_models` reads them from."""
    from npu_draft.factory.gguf_out import read_tokenizer_fields
    from npu_draft.gguf_tokenizer import write_tokenizer_files

    rows = read_tokenizer_fields(vocab_gguf, cache_file=out / "gguf-tokenizer-fields.json")
    write_tokenizer_files(
        rows, chat_template, out, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def _write_config_and_tokenizer(
    out: Path, shape: ModelShape, tokenizer_dir: Path, name: str
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape)
    config["_name_or_path"] = name
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / file, out / file)


def write_hf_folder(
    out: Path, shape: ModelShape, weights: Weights, tokenizer_dir: Path, name: str
) -> None:
    _write_config_and_tokenizer(out, shape, tokenizer_dir, name)
    save_file({k: v for k, v in weights.items()}, str(out / "model.safetensors"))


def write_hf_folder_streamed(
    out: Path, shape: ModelShape, tensors: Iterable[TensorSpec], tokenizer_dir: Path, name: str
) -> None:
    """`write_hf_folder` for float32 tensors made one at a time (a padded model that
    would not fit in memory at once); same file format."""
    _write_config_and_tokenizer(out, shape, tokenizer_dir, name)
    write_safetensors_streamed(out / "model.safetensors", tensors)


def write_safetensors_streamed(path: Path, tensors: Iterable[TensorSpec]) -> None:
    """A float32 safetensors file written tensor by tensor (the format: an 8-byte
    little-endian header length, a JSON header of dtype/shape/byte offsets padded
    to 8 bytes, then the raw data in header order)."""
    specs = list(tensors)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = int(np.prod(spec.shape)) * 4
        header[spec.name] = {
            "dtype": "F32",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for spec in specs:
            data = np.ascontiguousarray(spec.make(), dtype=np.float32)
            if data.shape != spec.shape:
                raise ValueError(f"{spec.name}: made {data.shape}, declared {spec.shape}")
            file.write(memoryview(data).cast("B"))
