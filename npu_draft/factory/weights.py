"""Random Qwen3 weights, their noisy copies, and cost padding.

Weights use Hugging Face tensor names and [out, in] layout. Initialisation is
deliberately wide (embeddings std 1, matrices std ~0.1): the usual small init
makes a random model repeat one token forever, and equality tests would then pass
for the wrong reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from npu_draft.factory.quant import BLOCK_TYPES, QK, quantize
from npu_draft.factory.shapes import ModelShape

Weights = dict[str, np.ndarray]


def layer_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Per-layer tensors (suffix after `model.layers.N.`) and their shapes."""
    h, q, kv, f = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.ffn,
    )
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (shape.head_dim,),
        "self_attn.k_norm.weight": (shape.head_dim,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }


def tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """All tensors of a model of this shape, in a fixed order."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, shape.hidden)}
    per_layer = layer_tensor_shapes(shape)
    for layer in range(shape.layers):
        for suffix, dims in per_layer.items():
            shapes[f"model.layers.{layer}.{suffix}"] = dims
    shapes["model.norm.weight"] = (shape.hidden,)
    shapes["lm_head.weight"] = (shape.vocab, shape.hidden)
    return shapes


# Standard deviation per tensor kind (suffix match); norms are ones.
_INIT_STD = {
    "embed_tokens": 1.0,
    "q_proj": 0.1,
    "k_proj": 0.1,
    "v_proj": 0.1,
    "o_proj": 0.08,
    "gate_proj": 0.1,
    "up_proj": 0.1,
    "down_proj": 0.07,
    "lm_head": 0.12,
}


def _init_std(name: str) -> float | None:
    for kind, std in _INIT_STD.items():
        if kind in name:
            return std
    return None  # a norm


def random_weights(shape: ModelShape, seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for name, dims in tensor_shapes(shape).items():
        std = _init_std(name)
        if std is None:
            # Norm weights near one, not exactly one, so a wrong norm placement shows.
            weights[name] = (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        else:
            weights[name] = (std * rng.standard_normal(dims)).astype(np.float32)
    return weights


def noisy_weights(weights: Weights, sigma: float, seed: int) -> Weights:
    """Add Gaussian noise of sigma x each tensor's own std (norms included)."""
    rng = np.random.default_rng(seed)
    noisy: Weights = {}
    for name, tensor in weights.items():
        std = float(tensor.std()) or 1.0
        noisy[name] = (tensor + sigma * std * rng.standard_normal(tensor.shape)).astype(np.float32)
    return noisy


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, shape and a function producing its data on demand.

    `make_quantized`, where given, returns exactly `quantize(make(), kind)` for a
    block type `kind` ("q8_0", "q4_0") but builds it from the tensor's known
    structure (zero padding, repeated filler) instead of quantizing every value;
    the GGUF writer prefers it.
    """

    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    make_quantized: Callable[[str], np.ndarray] | None = None


def _check_paddable(core: ModelShape, big: ModelShape) -> None:
    problems = []
    if big.head_dim != core.head_dim:
        problems.append("head_dim differs")
    if core.kv_heads > big.kv_heads or core.group > big.group:
        problems.append("core query heads do not fit the big model's KV grouping")
    if core.hidden > big.hidden or core.ffn > big.ffn or core.layers > big.layers:
        problems.append("core is larger than the target shape")
    if core.vocab != big.vocab:
        problems.append("vocabularies differ")
    if problems:
        raise ValueError(f"cannot pad {core} into {big}: " + "; ".join(problems))


def _query_head_rows(core: ModelShape, big: ModelShape) -> np.ndarray:
    """Rows of the big q_proj that receive each core query head, in core order.

    Core head j belongs to KV head j // core.group; it goes to the same KV group in
    the big model so grouped-query attention still pairs it with its own keys.
    """
    rows = []
    for head in range(core.heads):
        group, offset = divmod(head, core.group)
        big_head = group * big.group + offset
        rows.append(np.arange(big_head * big.head_dim, (big_head + 1) * big.head_dim))
    return np.concatenate(rows)


def _block_columns(cols: slice | np.ndarray, width: int) -> slice | np.ndarray | None:
    """Block indices of a column selection made of whole, aligned 32-column blocks.

    None when the selection splits a block (then the fast path does not apply).
    """
    if isinstance(cols, slice):
        start, stop, step = cols.indices(width)
        if step != 1 or start % QK or stop % QK:
            return None
        return slice(start // QK, stop // QK)
    if len(cols) % QK:
        return None
    groups = np.asarray(cols).reshape(-1, QK)
    first = groups[:, :1]
    if np.any(first % QK) or not np.array_equal(groups, first + np.arange(QK)):
        return None
    return groups[:, 0] // QK


def padded_tensors(
    core_weights: Weights, core: ModelShape, big: ModelShape, seed: int, dtype: np.dtype
) -> Iterator[TensorSpec]:
    """Tensors of a `big`-shaped model that computes exactly the core function.

    Zero padding keeps the extra hidden, head and FFN units at zero; RMSNorm weights
    are scaled by sqrt(h_small / h_big) because the norm now averages over more
    (zero) units; extra layers get random weights (full cost) but zero output
    projections, so they add nothing to the residual stream.

    `dtype` is that of `make()`'s arrays. Every 2-D tensor also gets
    `make_quantized`: its Q8_0 or Q4_0 bytes are zero blocks around the quantized
    core (the core occupies whole 32-column blocks) or the quantized filler,
    quantized once per shape and type and shared by every extra layer, so a
    32B-shaped target costs a few hundred million quantized values rather than 32
    billion.
    """
    _check_paddable(core, big)
    padding = _CorePadding(core_weights, core, big, seed, dtype)
    for name, dims in tensor_shapes(big).items():
        is_extra_layer = name.startswith("model.layers.") and int(name.split(".")[2]) >= core.layers
        yield padding.extra(name, dims) if is_extra_layer else padding.padded(name, dims)


class _CorePadding:
    """The tensors of `padded_tensors`: the core's zero-padded, extra layers' filler."""

    def __init__(
        self, core_weights: Weights, core: ModelShape, big: ModelShape, seed: int, dtype: np.dtype
    ) -> None:
        self.core_weights = core_weights
        self.dtype = dtype
        self.scale = math.sqrt(core.hidden / big.hidden)
        self.q_rows = _query_head_rows(core, big)
        self.h, self.f = core.hidden, core.ffn
        self.kv = core.kv_heads * core.head_dim
        self.rng = np.random.default_rng(seed)
        self.filler_cache: dict[tuple[int, ...], np.ndarray] = {}
        self.filler_blocks_cache: dict[tuple[tuple[int, ...], str], np.ndarray] = {}

    def filler(self, dims: tuple[int, ...], std: float) -> np.ndarray:
        # One random block per shape, reused by every extra layer: same cost, fast.
        if dims not in self.filler_cache:
            random = self.rng.standard_normal(dims, dtype=np.float32)
            self.filler_cache[dims] = (std * random).astype(self.dtype)
        return self.filler_cache[dims]

    def filler_blocks(self, dims: tuple[int, ...], std: float, kind: str) -> np.ndarray:
        if (dims, kind) not in self.filler_blocks_cache:
            self.filler_blocks_cache[dims, kind] = quantize(self.filler(dims, std), kind)
        return self.filler_blocks_cache[dims, kind]

    def placement(self, name: str) -> tuple[slice | np.ndarray, slice | np.ndarray]:
        """Where a 2-D core tensor sits in its zero-padded big tensor: out[rows, cols]."""
        h, f, kv = self.h, self.f, self.kv
        if name.endswith("q_proj.weight"):
            return self.q_rows, slice(0, h)
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            return slice(0, kv), slice(0, h)
        if name.endswith("o_proj.weight"):
            return slice(0, h), self.q_rows
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return slice(0, f), slice(0, h)
        if name.endswith("down_proj.weight"):
            return slice(0, h), slice(0, f)
        return slice(None), slice(0, h)  # embeddings and output head: [vocab, hidden]

    def padded(self, name: str, dims: tuple[int, ...]) -> TensorSpec:
        core_t = self.core_weights[name]
        make = partial(self.padded_array, name, dims, core_t)
        if len(dims) != 2:
            return TensorSpec(name, dims, make)
        return TensorSpec(name, dims, make, partial(self.padded_blocks, name, dims, core_t))

    def padded_array(self, name: str, dims: tuple[int, ...], core_t: np.ndarray) -> np.ndarray:
        out = np.zeros(dims, dtype=self.dtype)
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) or (
            name == "model.norm.weight"
        ):
            out[: self.h] = core_t * self.scale
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            out[:] = core_t
        else:
            out[self.placement(name)] = core_t
        return out

    def padded_blocks(
        self, name: str, dims: tuple[int, ...], core_t: np.ndarray, kind: str
    ) -> np.ndarray:
        rows, cols = self.placement(name)
        blocks = _block_columns(cols, dims[1])
        if blocks is None:
            return quantize(self.padded_array(name, dims, core_t), kind)
        block_bytes = BLOCK_TYPES[kind].block_bytes
        out = BLOCK_TYPES[kind].zeros(dims).reshape(dims[0], dims[1] // QK, block_bytes)
        quantized = quantize(core_t.astype(self.dtype), kind)
        both_arrays = not isinstance(rows, slice) and not isinstance(blocks, slice)
        index = np.ix_(rows, blocks) if both_arrays else (rows, blocks)
        out[index] = quantized.reshape(core_t.shape[0], -1, block_bytes)
        return out.reshape(BLOCK_TYPES[kind].byte_shape(dims))

    def extra(self, name: str, dims: tuple[int, ...]) -> TensorSpec:
        std = _init_std(name)
        dtype = self.dtype
        if std is None:  # a norm
            return TensorSpec(name, dims, lambda: np.ones(dims, dtype=dtype))
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return TensorSpec(
                name,
                dims,
                lambda: np.zeros(dims, dtype=dtype),
                lambda kind: BLOCK_TYPES[kind].zeros(dims),
            )
        return TensorSpec(
            name,
            dims,
            lambda: self.filler(dims, std),
            lambda kind: self.filler_blocks(dims, std, kind),
        )


def plain_tensors(weights: Weights, dtype: np.dtype) -> Iterator[TensorSpec]:
    for name, tensor in weights.items():
        yield TensorSpec(name, tuple(tensor.shape), lambda t=tensor: t.astype(dtype))
