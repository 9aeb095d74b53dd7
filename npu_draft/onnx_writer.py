"""A drafter folder for a Qwen3 checkpoint without PyTorch: the graph written with ONNX's helpers.

`npu_draft.export` runs onnxruntime-genai's model builder, which needs PyTorch (754 MB
even as the CPU build) to read the checkpoint. This module writes the same graph
the builder writes for Qwen3 in fp32, op for op, from the safetensors files with
numpy alone, so the demo and `npu-spec make-models` run without PyTorch:

- embedding Gather; RMSNorm as SimplifiedLayerNormalization, and
  SkipSimplifiedLayerNormalization where a residual is added before the norm;
- attention: one fused q/k/v MatMul, Qwen3's per-head RMSNorm on q and k, then
  GroupQueryAttention (com.microsoft) with rotary embedding from cos/sin tables and
  past/present KV that share one buffer (what both backends bind);
- SwiGLU MLP (SiLU written as x * Sigmoid(x)); final norm; the output head applied to
  the last input position only (see `export.keep_last_position_logits`).

Inputs `input_ids`, `attention_mask`, `past_key_values.N.key/value`; outputs `logits`
[batch, 1, vocab] and `present.N.key/value`. The folder is finished exactly as an
exported one (genai_config.json or not, tokenizer files, npu_draft.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npu_draft.drafter_folder import FORMATS, ExportError, finish_drafter_folder
from npu_draft.ort_backend import DEFAULT_MAX_CONTEXT
from npu_draft.tokenizer_check import DrafterManifest

log = logging.getLogger(__name__)

OPSET = 21
MS_DOMAIN = "com.microsoft"
MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
# SimplifiedLayerNormalization is an onnxruntime contrib op registered in the ONNX domain.
_MS_OPS = ("GroupQueryAttention", "SkipSimplifiedLayerNormalization")
WRITER_PRECISIONS = ("fp32", "fp16")
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def write_drafter(
    hf_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "genai",
    max_context: int = DEFAULT_MAX_CONTEXT,
    overwrite: bool = True,
    precision: str = "fp32",
) -> Path:
    """Write a drafter folder (fp32, or fp16 for CUDA: see `to_float16`) for the Qwen3
    checkpoint in `hf_dir`; return `out_dir`.

    Same contract as `export.export_drafter` (the folder appears whole or not at all).
    """
    if precision not in WRITER_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(WRITER_PRECISIONS)}")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if not (hf_dir / "config.json").is_file():
        raise ExportError(f"{hf_dir} is not a Hugging Face checkpoint folder (no config.json)")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty (use --force to replace it)")
    config = Qwen3Config.read(hf_dir / "config.json")
    context = min(config.max_positions, max_context)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as tmp:
        staging = Path(tmp) / "drafter"
        staging.mkdir()
        model = build_model(config, read_safetensors(hf_dir), context)
        save_graph(to_float16(model) if precision == "fp16" else model, staging)
        config.pad_token_id = _pad_token_id(hf_dir, config)
        (staging / "genai_config.json").write_text(
            json.dumps(genai_config(config, context), indent=4) + "\n"
        )
        finish_drafter_folder(hf_dir, staging, fmt, precision, max_context)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    log.info("drafter (%s, %s, written without PyTorch) in %s", fmt, precision, out_dir)
    return out_dir


def save_graph(model: onnx.ModelProto, folder: Path) -> None:
    """model.onnx with its weights in model.onnx.data beside it."""
    onnx.save(
        model,
        str(folder / MODEL_FILE),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=1024,  # shape constants stay inline: shape inference reads them
    )
    (folder / DATA_FILE).chmod(0o644)  # onnx creates it private; the folder is shared


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float32 weight, input and output as float16 (the ops this writer uses are
    all type-generic; the norms keep their float32 stash type). The CUDA provider needs
    it: see `onnx_runner._attention_provider`."""
    graph = model.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            half = numpy_helper.to_array(tensor).astype(np.float16)
            graph.initializer[index].CopyFrom(numpy_helper.from_array(half, tensor.name))
    for value in (*graph.input, *graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def float16_copy(folder: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`: the drafter folder `folder` (written by this module, fp32) with its
    graph in fp16, for the CUDA provider; the other files copied as they are."""
    folder, out_dir = Path(folder), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file() and path.name not in (MODEL_FILE, DATA_FILE):
            shutil.copy2(path, out_dir / path.name)
    save_graph(to_float16(onnx.load(str(folder / MODEL_FILE))), out_dir)
    manifest = DrafterManifest.read(out_dir)
    if manifest is not None:
        dataclasses.replace(manifest, precision="fp16").write(out_dir)
    return out_dir


class Qwen3Config:
    """The fields of a Qwen3 config.json the graph needs; anything else is refused."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw
        self.hidden = int(raw["hidden_size"])
        self.ffn = int(raw["intermediate_size"])
        self.layers = int(raw["num_hidden_layers"])
        self.heads = int(raw["num_attention_heads"])
        self.kv_heads = int(raw.get("num_key_value_heads") or self.heads)
        self.head_dim = int(raw.get("head_dim") or self.hidden // self.heads)
        self.vocab = int(raw["vocab_size"])
        self.eps = float(raw.get("rms_norm_eps", 1e-6))
        rope = raw.get("rope_parameters") or {}  # transformers 5 nests it here
        self.rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))
        self.tied = bool(raw.get("tie_word_embeddings", False))
        self.max_positions = int(raw.get("max_position_embeddings", DEFAULT_MAX_CONTEXT))
        self.pad_token_id: int | None = raw.get("pad_token_id")

    @classmethod
    def read(cls, path: Path) -> Qwen3Config:
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "qwen3":
            raise ExportError(
                f"{path}: model_type {raw.get('model_type')!r}; the PyTorch-free writer "
                f"knows Qwen3 only (install 'npu-spec[export]' for the model builder)"
            )
        ropes = [raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}]
        unsupported = {
            "attention_bias": bool(raw.get("attention_bias")),
            "use_sliding_window": bool(raw.get("use_sliding_window")),
            f"hidden_act {raw.get('hidden_act')}": raw.get("hidden_act", "silu") != "silu",
            "rope scaling": any(
                rope.get("rope_type", rope.get("type", "default")) != "default" for rope in ropes
            ),
        }
        named = [name for name, present in unsupported.items() if present]
        if named:
            raise ExportError(f"{path}: the PyTorch-free writer does not handle {', '.join(named)}")
        return cls(raw)


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 (bfloat16 widened exactly).

    numpy has no bfloat16, so the files are read directly: an 8-byte header length,
    a JSON header of dtype/shape/offsets, then the raw little-endian data.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: no .safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(_read_one_safetensors(path))
    return tensors


def _read_one_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (header_size,) = struct.unpack("<Q", bytes(data[:8]))
    header = json.loads(bytes(data[8 : 8 + header_size]))
    body = 8 + header_size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ExportError(f"{path}: {name} is {entry['dtype']}; only F32/F16/BF16 are read")
        start, end = entry["data_offsets"]
        raw = data[body + start : body + end].view(dtype).reshape(entry["shape"])
        if entry["dtype"] == "BF16":
            yield name, (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            yield name, raw.astype(np.float32)


def rotary_tables(config: Qwen3Config, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [positions, head_dim / 2], computed in float32 as transformers does."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.int64).astype(np.float32)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** (exponents / config.head_dim))).astype(
        np.float32
    )
    angles = np.outer(np.arange(positions, dtype=np.float32), inv_freq).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class _Graph:
    """Nodes and initializers in the order they are added, with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(
        self, op: str, inputs: list[str], name: str, outputs: int | list[str] = 1, **attrs
    ) -> list[str]:
        """Add a node; `outputs` is a count (named after the node) or explicit names
        ("" for an optional output left out)."""
        domain = MS_DOMAIN if op in _MS_OPS else ""
        if isinstance(outputs, int):
            outputs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs


def build_model(
    config: Qwen3Config, weights: dict[str, np.ndarray], context: int
) -> onnx.ModelProto:
    """The decoder graph with its weights (see the module docstring); consumes `weights`."""
    writer = _DecoderWriter(config, weights)
    hidden = writer.embedding()
    mask = writer.attention_mask_inputs(context)
    normed = writer.norm(
        hidden, "model.layers.0.input_layernorm", "/model/layers.0/input_layernorm"
    )
    residual = hidden
    for layer in range(config.layers):
        normed, residual = writer.layer(layer, normed, residual, mask)
    writer.head(normed)
    return writer.model()


class _DecoderWriter:
    """Writes the builder's Qwen3 graph piece by piece (names follow the builder's)."""

    def __init__(self, config: Qwen3Config, weights: dict[str, np.ndarray]) -> None:
        self.c, self.weights, self.g = config, weights, _Graph()
        q_size, kv_size = config.heads * config.head_dim, config.kv_heads * config.head_dim
        constant = self._int64_constant
        self.qkv_sizes = constant("qkv_sizes", [q_size, kv_size, kv_size])
        self.per_head = constant("[0, -1, head_dim]", [0, -1, config.head_dim])
        self.flat = {"q": constant("[0, -1, q_size]", [0, -1, q_size])}
        self.flat["k"] = constant("[0, -1, kv_size]", [0, -1, kv_size])

    def _int64_constant(self, name: str, values: list[int] | int) -> str:
        return self.g.weight(f"/model/constants/INT64/{name}", np.array(values, np.int64))

    def _linear(self, prefix: str, source: str) -> str:
        """A MatMul weight: HF stores [out, in], MatMul takes [in, out]."""
        return self.g.weight(f"{prefix}.MatMul.weight", self.weights.pop(f"{source}.weight").T)

    def embedding(self) -> str:
        self.embed = self.weights.pop("model.embed_tokens.weight")
        name = self.g.weight("model.embed_tokens.weight", self.embed)
        return self.g.node("Gather", [name, "input_ids"], "/model/embed_tokens/Gather")[0]

    def attention_mask_inputs(self, context: int) -> list[str]:
        """GroupQueryAttention's seqlens_k (tokens before the last), total length, cos, sin."""
        g, one = self.g, self._int64_constant("[1]", [1])
        (summed,) = g.node(
            "ReduceSum", ["attention_mask", one], "/model/attn_mask/ReduceSum", keepdims=0
        )
        (last,) = g.node("Sub", [summed, one], "/model/attn_mask/Sub")
        (seqlens_k,) = g.node("Cast", [last], "/model/attn_mask/seqlens_k", to=TensorProto.INT32)
        (shape,) = g.node("Shape", ["attention_mask"], "/model/attn_mask/Shape")
        index = self._int64_constant("1", 1)
        (total,) = g.node("Gather", [shape, index], "/model/attn_mask/Gather", axis=0)
        (length,) = g.node("Cast", [total], "/model/attn_mask/total_length", to=TensorProto.INT32)
        cos, sin = rotary_tables(self.c, context)
        return [seqlens_k, length, g.weight("cos_cache", cos), g.weight("sin_cache", sin)]

    def norm(self, x: str, weight: str, name: str, stored_as: str | None = None) -> str:
        gamma = self.g.weight(stored_as or f"{weight}.weight", self.weights.pop(f"{weight}.weight"))
        return self.g.node(
            "SimplifiedLayerNormalization", [x, gamma], name, epsilon=self.c.eps, axis=-1,
            stash_type=1,
        )[0]  # fmt: skip

    def skip_norm(self, residual: str, x: str, weight: str, name: str) -> tuple[str, str]:
        """RMSNorm(residual + x) and residual + x."""
        gamma = self.g.weight(f"{weight}.weight", self.weights.pop(f"{weight}.weight"))
        outputs = [f"{name}/output_0", "", "", f"{name}/output_3"]  # no mean / inverse std
        normed, _, _, total = self.g.node(
            "SkipSimplifiedLayerNormalization", [residual, x, gamma], name, outputs=outputs,
            epsilon=self.c.eps,
        )  # fmt: skip
        return normed, total

    def layer(self, layer: int, normed: str, residual: str, mask: list[str]) -> tuple[str, str]:
        """One decoder layer; returns the next layer's normed input (or the final norm's
        output) and the residual stream."""
        c, g = self.c, self.g
        p, n = f"model.layers.{layer}", f"/model/layers.{layer}"
        qkv_weight = np.concatenate(
            [self.weights.pop(f"{p}.self_attn.{x}_proj.weight") for x in ("q", "k", "v")]
        ).T
        qkv_name = g.weight(f"{p}.attn.qkv_proj.MatMul.weight", qkv_weight)
        (qkv,) = g.node("MatMul", [normed, qkv_name], f"{n}/attn/qkv_proj/MatMul")
        q, k, v = g.node(
            "Split", [qkv, self.qkv_sizes], f"{n}/attn/qkv_proj/Split", outputs=3, axis=-1
        )
        per_head_normed = {}
        for which, projected in (("q", q), ("k", k)):  # Qwen3: RMSNorm over each head
            prefix = f"{n}/attn/{which}_norm"
            (heads,) = g.node("Reshape", [projected, self.per_head], f"{prefix}/Reshape_1")
            normed_heads = self.norm(
                heads, f"{p}.self_attn.{which}_norm", f"{prefix}/SimplifiedLayerNormalization",
                stored_as=f"{p}.attn.{which}_norm.layernorm.weight",
            )  # fmt: skip
            (flat,) = g.node("Reshape", [normed_heads, self.flat[which]], f"{prefix}/Reshape_2")
            per_head_normed[which] = flat
        past = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        present = [f"present.{layer}.key", f"present.{layer}.value"]
        attention = g.node(
            "GroupQueryAttention", [per_head_normed["q"], per_head_normed["k"], v, *past, *mask],
            f"{n}/attn/GroupQueryAttention",
            outputs=[f"{n}/attn/GroupQueryAttention/output_0", *present],
            num_heads=c.heads, kv_num_heads=c.kv_heads, scale=float(c.head_dim**-0.5),
            local_window_size=-1, softcap=0.0, do_rotary=1, rotary_interleaved=0,
        )[0]  # fmt: skip
        o_proj = self._linear(f"{p}.attn.o_proj", f"{p}.self_attn.o_proj")
        (attn_out,) = g.node("MatMul", [attention, o_proj], f"{n}/attn/o_proj/MatMul")
        mlp_in, residual = self.skip_norm(
            residual, attn_out, f"{p}.post_attention_layernorm", f"{n}/post_attention_layernorm"
        )
        projections = {}
        for proj in ("gate", "up"):
            weight = self._linear(f"{p}.mlp.{proj}_proj", f"{p}.mlp.{proj}_proj")
            (projections[proj],) = g.node("MatMul", [mlp_in, weight], f"{n}/mlp/{proj}_proj/MatMul")
        (sigmoid,) = g.node("Sigmoid", [projections["gate"]], f"{n}/mlp/act_fn/Sigmoid")
        (silu,) = g.node("Mul", [projections["gate"], sigmoid], f"{n}/mlp/act_fn/Mul")
        (gated,) = g.node("Mul", [silu, projections["up"]], f"{n}/mlp/Mul")
        down_weight = self._linear(f"{p}.mlp.down_proj", f"{p}.mlp.down_proj")
        (down,) = g.node("MatMul", [gated, down_weight], f"{n}/mlp/down_proj/MatMul")
        if layer + 1 < c.layers:
            weight, name = (
                f"model.layers.{layer + 1}.input_layernorm",
                f"/model/layers.{layer + 1}/input_layernorm",
            )
        else:
            weight, name = "model.norm", "/model/final_norm"
        return self.skip_norm(residual, down, weight, name)

    def head(self, normed: str) -> None:
        """The output head on the last position only (a drafter needs no other logits)."""
        constant = self.g.weight
        starts = constant("/lm_head/last_position/starts", np.array([-1], np.int64))
        ends = constant("/lm_head/last_position/ends", np.array([2**62], np.int64))
        axes = constant("/lm_head/last_position/axes", np.array([1], np.int64))
        (last,) = self.g.node("Slice", [normed, starts, ends, axes], "/lm_head/last_position")
        head = self.embed if self.c.tied else self.weights.pop("lm_head.weight")
        name = self.g.weight("lm_head.MatMul.weight", head.T)
        self.g.node("MatMul", [last, name], "/lm_head/MatMul", outputs=["logits"])

    def model(self) -> onnx.ModelProto:
        c = self.c

        def value(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, dtype, shape)

        def kv(length: str) -> list:
            return ["batch_size", c.kv_heads, length, c.head_dim]

        inputs = [
            value("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            value("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        ]
        outputs = [value("logits", TensorProto.FLOAT, ["batch_size", 1, c.vocab])]
        for layer in range(c.layers):
            for kind in ("key", "value"):
                past = f"past_key_values.{layer}.{kind}"
                inputs.append(value(past, TensorProto.FLOAT, kv("past_sequence_length")))
                present = f"present.{layer}.{kind}"
                outputs.append(value(present, TensorProto.FLOAT, kv("total_sequence_length")))
        graph = helper.make_graph(
            self.g.nodes, "qwen3_drafter", inputs, outputs, self.g.initializers
        )
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
            producer_name="npu-spec",
            ir_version=10,
        )


def _pad_token_id(hf_dir: Path, config: Qwen3Config) -> int | None:
    """As the model builder resolves it: the config's, the tokenizer's, else the first eos."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    tokenizer_config, tokenizer = hf_dir / "tokenizer_config.json", hf_dir / "tokenizer.json"
    if tokenizer_config.is_file() and tokenizer.is_file():
        pad = json.loads(tokenizer_config.read_text()).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        for added in json.loads(tokenizer.read_text()).get("added_tokens", []):
            if pad is not None and added.get("content") == pad:
                return int(added["id"])
    eos = config.raw.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


def genai_config(config: Qwen3Config, context: int) -> dict:
    """genai_config.json as the model builder writes it for Qwen3 on the CPU."""
    eos = config.raw.get("eos_token_id", [])
    return {
        "model": {
            "bos_token_id": config.raw.get("bos_token_id"),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": config.head_dim,
                "hidden_size": config.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": config.heads,
                "num_hidden_layers": config.layers,
                "num_key_value_heads": config.kv_heads,
            },
            "eos_token_id": eos if isinstance(eos, list) else [eos],
            "pad_token_id": config.pad_token_id,
            "type": "qwen3",
            "vocab_size": config.vocab,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }
