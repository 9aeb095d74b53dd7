"""Cost-padded drafts without a server: shapes, defaults, head grouping, exact maths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from npu_draft.factory.gguf_out import gguf_tensor_name
from npu_draft.factory.hf_out import write_safetensors_streamed
from npu_draft.factory.make import (
    DraftSpec,
    _draft_weight_type,
    draft_weights,
    stored_function_weights,
)
from npu_draft.factory.quant import dequantize, quantize_q4_0, quantize_q8_0
from npu_draft.factory.shapes import CORE, DRAFT_SHAPES, TARGET_SHAPES, default_draft_shape
from npu_draft.factory.weights import _query_head_rows, padded_tensors, random_weights
from tests.support.reference import Qwen3Config, Qwen3Numpy

TOKENS = [9707, 11, 847, 829, 374, 1207, 3555, 279, 6722, 315, 9625, 30]


def _numpy_model(shape, weights) -> Qwen3Numpy:
    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    return Qwen3Numpy(config, weights)


def test_published_draft_shapes() -> None:
    small = DRAFT_SHAPES["qwen3-0.6b"]
    assert (small.hidden, small.layers, small.heads, small.kv_heads, small.ffn) == (
        1024, 28, 16, 8, 3072,
    )  # fmt: skip
    medium = DRAFT_SHAPES["qwen3-1.7b"]
    assert (medium.hidden, medium.layers, medium.heads, medium.kv_heads, medium.ffn) == (
        2048, 28, 16, 8, 6144,
    )  # fmt: skip
    assert DRAFT_SHAPES["core"] == CORE


@pytest.mark.parametrize(
    ("target", "draft"),
    [("small", "core"), ("padded-test", "core"), ("qwen3-8b", "qwen3-0.6b"),
     ("qwen3-14b", "qwen3-0.6b"), ("qwen3-32b", "qwen3-0.6b")],
)  # fmt: skip
def test_default_draft_shape(target: str, draft: str) -> None:
    assert target in TARGET_SHAPES
    assert default_draft_shape(target) == draft


def test_default_draft_weight_types() -> None:
    assert _draft_weight_type(None, "core") == "float32"
    assert _draft_weight_type(None, "padded-test") == "float32"
    assert _draft_weight_type(None, "qwen3-0.6b") == "q8_0"
    assert _draft_weight_type("float16", "qwen3-0.6b") == "float16"


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b"])
def test_qwen3_draft_shapes_pad_the_core_with_its_own_kv_heads(name: str) -> None:
    """Tensor shapes of the padded draft, without making 600M values, and the head map."""
    big = DRAFT_SHAPES[name]
    specs = {spec.name: spec for spec in padded_tensors(random_weights(CORE, 0), CORE, big, 0,
                                                       np.dtype(np.float32))}  # fmt: skip
    assert len(specs) == 3 + 11 * big.layers
    assert specs["model.embed_tokens.weight"].shape == (151_936, big.hidden)
    assert specs["lm_head.weight"].shape == (151_936, big.hidden)
    last = f"model.layers.{big.layers - 1}.self_attn"
    assert specs[f"{last}.q_proj.weight"].shape == (big.heads * 128, big.hidden)
    assert specs[f"{last}.k_proj.weight"].shape == (big.kv_heads * 128, big.hidden)
    assert specs["model.layers.0.mlp.down_proj.weight"].shape == (big.hidden, big.ffn)
    assert {gguf_tensor_name(n) for n in specs} >= {"output.weight", "blk.27.ffn_down.weight"}
    # Core heads 0,1 share KV head 0 and 2,3 share KV head 1; with 2 query heads per KV
    # head in the big model they land on big heads 0,1 (KV 0) and 2,3 (KV 1).
    rows = _query_head_rows(CORE, big).reshape(CORE.heads, 128)[:, 0] // 128
    assert list(rows) == [0, 1, 2, 3]
    assert [int(head) // big.group for head in rows] == [0, 0, 1, 1]


@pytest.mark.parametrize("draft", ["same", "noisy:0.03", "unrelated"])
def test_padded_draft_computes_the_core_draft_function(draft: str) -> None:
    core = random_weights(CORE, 0)
    drafted = draft_weights(core, DraftSpec.parse(draft), 0)
    big = DRAFT_SHAPES["padded-test"]
    padded = {spec.name: spec.make() for spec in padded_tensors(drafted, CORE, big, 0,
                                                                np.dtype(np.float32))}  # fmt: skip
    core_model, big_model = _numpy_model(CORE, drafted), _numpy_model(big, padded)
    expected = core_model.forward(TOKENS, core_model.new_cache(32))
    got = big_model.forward(TOKENS, big_model.new_cache(32))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.argmax(got, -1), np.argmax(expected, -1))


def test_streamed_safetensors_loads_back_exactly(tmp_path: Path) -> None:
    big = DRAFT_SHAPES["padded-test"]
    specs = list(padded_tensors(random_weights(CORE, 1), CORE, big, 0, np.dtype(np.float32)))
    path = tmp_path / "model.safetensors"
    write_safetensors_streamed(path, specs)
    loaded = load_file(str(path))
    assert set(loaded) == {spec.name for spec in specs}
    for spec in specs[:5] + specs[-3:]:
        assert np.array_equal(loaded[spec.name], spec.make()), spec.name
    header_size = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_size % 8 == 0
    header = json.loads(path.read_bytes()[8 : 8 + header_size])
    assert header["__metadata__"] == {"format": "pt"}


def test_drafts_of_a_quantized_target_start_from_what_it_computes() -> None:
    core = random_weights(CORE, 0)
    assert stored_function_weights(core, "float16") is core
    seen = stored_function_weights(core, "q4_0")
    name = "model.layers.0.mlp.up_proj.weight"
    expected = dequantize(quantize_q4_0(core[name]), "q4_0", core[name].shape)
    assert np.array_equal(seen[name], expected) and not np.array_equal(seen[name], core[name])
    head = core["lm_head.weight"]  # stored Q8_0 in a Q4_0 file
    assert np.array_equal(seen["lm_head.weight"], dequantize(quantize_q8_0(head), "q8_0",
                                                             head.shape))  # fmt: skip
    assert np.array_equal(seen["model.norm.weight"], core["model.norm.weight"])
