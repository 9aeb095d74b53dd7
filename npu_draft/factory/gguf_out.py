"""Write Qwen3 GGUF files that the stock llama-server loads.

Tensors are streamed one at a time, so a 14B- or 32B-shaped padded target never
has to fit in memory. Tokenizer metadata is copied from llama.cpp's own
`ggml-vocab-qwen2.gguf`
(see `read_tokenizer_fields`); the chat template is the real Qwen3 one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from npu_draft.factory.shapes import ModelShape
from npu_draft.factory.weights import TensorSpec

ARCH = "qwen3"
CONTEXT_LENGTH = 32768
ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6
EOS_TOKEN_ID = 151645  # <|im_end|>, as in the released Qwen3 instruct models
BOS_TOKEN_ID = 151643  # <|endoftext|>; Qwen3 adds no BOS

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[suffix]}"


def read_tokenizer_fields(vocab_gguf: Path, cache_file: Path | None = None) -> list[list]:
    """The `tokenizer.*` key/values of a vocab GGUF as [key, type, subtype, value] rows.

    gguf's reader takes ~30 s on the 151k-token vocabulary, so the rows are kept in
    a JSON cache file next to the converted tokenizer.
    """
    if cache_file is not None and cache_file.is_file():
        return json.loads(cache_file.read_text())
    rows = []
    for key, field in GGUFReader(vocab_gguf).fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            sub_type = int(field.types[-1]) if field.types[0] == GGUFValueType.ARRAY else None
            rows.append([key, int(field.types[0]), sub_type, field.contents()])
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(cache_file)
    return rows


def _add_tokenizer(writer: GGUFWriter, tokenizer_fields: list[list]) -> None:
    for key, value_type, sub_type, value in tokenizer_fields:
        if key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"):
            continue  # set below to Qwen3's values
        writer.add_key_value(
            key,
            value,
            GGUFValueType(value_type),
            sub_type=None if sub_type is None else GGUFValueType(sub_type),
        )
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_add_bos_token(False)


def write_gguf(
    path: Path,
    shape: ModelShape,
    tensors: Iterable[TensorSpec],
    dtype: np.dtype,
    tokenizer_fields: list[list],
    chat_template: str,
    name: str,
) -> None:
    """Write one model; 1-D tensors (norms) are always float32, as llama.cpp expects."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    writer = GGUFWriter(tmp, ARCH)
    writer.add_name(name)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_file_type(1 if np.dtype(dtype) == np.float16 else 0)
    _add_tokenizer(writer, tokenizer_fields)
    writer.add_chat_template(chat_template)

    specs = list(tensors)
    for spec in specs:
        tensor_dtype = np.dtype(np.float32) if len(spec.shape) == 1 else np.dtype(dtype)
        raw = GGMLQuantizationType.F16 if tensor_dtype == np.float16 else GGMLQuantizationType.F32
        nbytes = int(np.prod(spec.shape)) * tensor_dtype.itemsize
        writer.add_tensor_info(gguf_tensor_name(spec.name), spec.shape, tensor_dtype, nbytes, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for spec in specs:
        data = spec.make()
        tensor_dtype = np.float32 if len(spec.shape) == 1 else dtype
        writer.write_tensor_data(np.ascontiguousarray(data, dtype=tensor_dtype))
    writer.close()
    tmp.replace(path)
