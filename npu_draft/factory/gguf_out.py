"""Write Qwen3 GGUF files that the stock llama-server loads.

Tensors are streamed one at a time, so a 14B- or 32B-shaped padded target never
has to fit in memory. Tokenizer metadata is copied from llama.cpp's own
`ggml-vocab-qwen2.gguf`
(see `read_tokenizer_fields`); the chat template is the real Qwen3 one.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from npu_draft.factory.quant import BLOCK_TYPES, quantize
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

    gguf's reader is slow on the 151k-token vocabulary (tens of seconds;
    docs/BENCHMARKS.md), so the rows are kept in a JSON cache file next to the converted tokenizer.
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


# Byte sizes of GGUF scalar value types (GGUFValueType); 8 = string, 9 = array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensor_types(path: Path) -> tuple[int | None, dict[str, tuple[tuple[int, ...], int]]]:
    """`general.file_type` and each tensor's (numpy-order shape, GGML type) of a GGUF file.

    Reads the header only and skips the tokenizer arrays, where gguf's GGUFReader
    spends seconds parsing the 151k-token vocabulary (docs/BENCHMARKS.md).
    """
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        offset = 24

        def string() -> str:
            nonlocal offset
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 8 + length
            return bytes(data[offset - length : offset]).decode()

        def skip(value_type: int) -> None:
            nonlocal offset
            if value_type == 8:
                string()
            elif value_type == 9:
                item_type, count = struct.unpack_from("<IQ", data, offset)
                offset += 12
                if item_type in _GGUF_SCALAR_SIZES:
                    offset += count * _GGUF_SCALAR_SIZES[item_type]
                else:
                    for _ in range(count):
                        skip(item_type)
            else:
                offset += _GGUF_SCALAR_SIZES[value_type]

        file_type = None
        for _ in range(n_kv):
            key = string()
            (value_type,) = struct.unpack_from("<I", data, offset)
            offset += 4
            if key == "general.file_type":
                (file_type,) = struct.unpack_from("<I", data, offset)
            skip(value_type)
        tensors = {}
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", data, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
            tensor_type, _ = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            tensors[name] = (tuple(reversed(dims)), tensor_type)
    return file_type, tensors


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


# Weight types of 2-D tensors and the GGUF `general.file_type` (llama_ftype) each implies.
WEIGHT_TYPES = {
    "float32": (GGMLQuantizationType.F32, 0),  # LLAMA_FTYPE_ALL_F32
    "float16": (GGMLQuantizationType.F16, 1),  # LLAMA_FTYPE_MOSTLY_F16
    "q8_0": (GGMLQuantizationType.Q8_0, 7),  # LLAMA_FTYPE_MOSTLY_Q8_0
    "q4_0": (GGMLQuantizationType.Q4_0, 2),  # LLAMA_FTYPE_MOSTLY_Q4_0
}
_QUANTIZED = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_0: "q4_0"}
# llama-quantize gives a Q4_0 file's output head Q6_K, which numpy cannot write here;
# Q8_0 is the nearest type we can (8.5 bits a weight against Q6_K's 6.56; qwen3-14b's
# head reads ~190 MB more per token than llama-quantize's file, ~2% of the model).
_OUTPUT_HEAD_TYPE = {"q4_0": "q8_0"}
OUTPUT_HEAD = "lm_head.weight"
GGML_QUANTIZATION_VERSION = 2  # what llama-quantize and convert_hf_to_gguf.py record


def weight_type_name(dtype: str | np.dtype | type) -> str:
    """'float32', 'float16', 'q8_0' or 'q4_0' for a numpy dtype or one of those names."""
    if isinstance(dtype, str) and dtype.lower() in _QUANTIZED.values():
        return dtype.lower()
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {dtype!r}; one of {sorted(WEIGHT_TYPES)}")
    return name


def tensor_weight_type(name: str, shape: tuple[int, ...], weight_type: str) -> str:
    """The type one tensor is stored in, in a file of `weight_type`."""
    if len(shape) == 1:
        return "float32"
    return _OUTPUT_HEAD_TYPE.get(weight_type, weight_type) if name == OUTPUT_HEAD else weight_type


def _tensor_layout(spec: TensorSpec, weight_type: str) -> tuple[GGMLQuantizationType, tuple, int]:
    """GGML type, shape as add_tensor_info takes it, and byte count of one tensor.

    1-D tensors (norms) are always float32, as llama.cpp expects (llama-quantize
    leaves them so too); token embeddings and output head follow the weight type,
    as llama-quantize does for a Q8_0 file type (a Q4_0 file's head: see
    _OUTPUT_HEAD_TYPE).
    """
    kind = tensor_weight_type(spec.name, spec.shape, weight_type)
    if kind in BLOCK_TYPES:
        byte_shape = BLOCK_TYPES[kind].byte_shape(spec.shape)
        return WEIGHT_TYPES[kind][0], byte_shape, int(np.prod(byte_shape))
    itemsize = np.dtype(kind).itemsize
    return WEIGHT_TYPES[kind][0], spec.shape, int(np.prod(spec.shape)) * itemsize


def _tensor_data(spec: TensorSpec, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type in _QUANTIZED:
        kind = _QUANTIZED[ggml_type]
        made = spec.make_quantized
        data = made(kind) if made is not None else quantize(spec.make(), kind)
        return np.ascontiguousarray(data, dtype=np.uint8)
    dtype = np.float16 if ggml_type == GGMLQuantizationType.F16 else np.float32
    return np.ascontiguousarray(spec.make(), dtype=dtype)


def write_gguf(
    path: Path,
    shape: ModelShape,
    tensors: Iterable[TensorSpec],
    dtype: str | np.dtype | type,
    tokenizer_fields: list[list],
    chat_template: str,
    name: str,
) -> None:
    """Write one model with 2-D weights of `dtype` (float32, float16, q8_0 or q4_0).

    1-D tensors (norms) are always float32. The next tensor is made (and quantized)
    in a background thread while the current one is written.
    """
    weight_type = weight_type_name(dtype)
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
    writer.add_file_type(WEIGHT_TYPES[weight_type][1])
    if weight_type in BLOCK_TYPES:
        writer.add_quantization_version(GGML_QUANTIZATION_VERSION)
    _add_tokenizer(writer, tokenizer_fields)
    writer.add_chat_template(chat_template)

    specs = list(tensors)
    layouts = [_tensor_layout(spec, weight_type) for spec in specs]
    for spec, (ggml_type, info_shape, nbytes) in zip(specs, layouts, strict=True):
        info_dtype = np.dtype(np.uint8 if ggml_type in _QUANTIZED else np.float32)
        writer.add_tensor_info(
            gguf_tensor_name(spec.name), info_shape, info_dtype, nbytes, ggml_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    # Tensors are made in order (the padded target's random filler depends on it), one
    # ahead of the writer, so at most two sit in memory.
    with ThreadPoolExecutor(1) as maker:
        pending = None
        for spec, (ggml_type, _, _) in zip(specs, layouts, strict=True):
            made = maker.submit(_tensor_data, spec, ggml_type)
            if pending is not None:
                writer.write_tensor_data(pending.result())
            pending = made
        if pending is not None:
            writer.write_tensor_data(pending.result())
    writer.close()
    tmp.replace(path)
