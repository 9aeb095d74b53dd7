"""Model factory logic that needs no server: specs, padding maths, noise."""

from __future__ import annotations

import numpy as np
import pytest

from npu_draft.factory.gguf_out import WEIGHT_TYPES, gguf_tensor_name, weight_type_name
from npu_draft.factory.make import DraftSpec
from npu_draft.factory.shapes import CORE, TARGET_SHAPES, ModelShape
from npu_draft.factory.weights import (
    noisy_weights,
    padded_tensors,
    random_weights,
    tensor_shapes,
)
from tests.support.reference import Qwen3Config, Qwen3Numpy


def _numpy_model(shape: ModelShape, weights: dict[str, np.ndarray]) -> Qwen3Numpy:
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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("same", DraftSpec("same")),
        ("unrelated", DraftSpec("unrelated")),
        ("noisy", DraftSpec("noisy", 0.05)),
        ("noisy:0.2", DraftSpec("noisy", 0.2)),
    ],
)
def test_draft_spec_parses(text: str, expected: DraftSpec) -> None:
    assert DraftSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["noisy:abc", "noisy:-1", "same:1", "other", ""])
def test_draft_spec_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        DraftSpec.parse(text)


def test_random_weights_are_deterministic_per_seed() -> None:
    a, b, c = random_weights(CORE, 3), random_weights(CORE, 3), random_weights(CORE, 4)
    assert all(np.array_equal(a[name], b[name]) for name in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_noise_scales_with_each_tensors_std() -> None:
    core = random_weights(CORE, 0)
    noisy = noisy_weights(core, 0.1, seed=1)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        ratio = np.std(noisy[name] - core[name]) / np.std(core[name])
        assert ratio == pytest.approx(0.1, rel=0.05)


def test_every_tensor_has_a_gguf_name() -> None:
    names = {gguf_tensor_name(name) for name in tensor_shapes(TARGET_SHAPES["qwen3-14b"])}
    assert len(names) == len(tensor_shapes(TARGET_SHAPES["qwen3-14b"]))
    assert {"token_embd.weight", "output.weight", "blk.39.ffn_down.weight"} <= names


def test_padded_model_computes_the_core_function() -> None:
    """The padding maths on its own: padded logits equal core logits in exact float32."""
    core_weights = random_weights(CORE, 0)
    big = TARGET_SHAPES["padded-test"]
    padded = {
        spec.name: spec.make() for spec in padded_tensors(core_weights, CORE, big, 0, np.float32)
    }
    assert padded["model.layers.0.self_attn.q_proj.weight"].shape == (big.heads * 128, big.hidden)
    tokens = [9707, 11, 847, 829, 374, 1207, 3555, 279, 6722, 315, 9625, 30]
    core_logits = _numpy_model(CORE, core_weights).forward(
        tokens, _numpy_model(CORE, core_weights).new_cache(32)
    )
    big_model = _numpy_model(big, padded)
    big_logits = big_model.forward(tokens, big_model.new_cache(32))
    np.testing.assert_allclose(big_logits, core_logits, rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.argmax(big_logits, -1), np.argmax(core_logits, -1))


def test_padding_refuses_shapes_that_break_the_head_grouping() -> None:
    core_weights = random_weights(CORE, 0)
    narrow = ModelShape(hidden=512, layers=4, heads=2, kv_heads=2, ffn=1024)  # group 1 < 2
    with pytest.raises(ValueError, match="grouping"):
        list(padded_tensors(core_weights, CORE, narrow, 0, np.float32))


@pytest.mark.parametrize(
    ("dtype", "name", "file_type"),
    [
        (np.float32, "float32", 0),
        ("float16", "float16", 1),
        (np.dtype(np.float16), "float16", 1),
        ("q8_0", "q8_0", 7),
        ("Q8_0", "q8_0", 7),
        ("q4_0", "q4_0", 2),
    ],
)
def test_weight_types_and_their_gguf_file_types(dtype, name: str, file_type: int) -> None:
    assert weight_type_name(dtype) == name
    # llama.h: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7
    assert WEIGHT_TYPES[name][1] == file_type


@pytest.mark.parametrize("dtype", ["q4_1", "bfloat16", np.int8])
def test_unsupported_weight_types_are_refused(dtype) -> None:
    with pytest.raises(ValueError, match="unsupported weight type"):
        weight_type_name(dtype)
