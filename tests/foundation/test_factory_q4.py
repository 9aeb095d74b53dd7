"""Q4_0 targets: the quantizer, its structured fast path, and the real llama-server.

A Q4_0 target is for benchmarks (what a 14B costs as users run it), not for
equality: the quantized core computes the core function only roughly, so the
server test asserts loading, tensor types and sensible generation, and records
how often its greedy tokens agree with the float core's.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from npu_draft.factory import write_target
from npu_draft.factory.gguf_out import read_tensor_types
from npu_draft.factory.make import _core_weights, stored_function_weights
from npu_draft.factory.quant import BLOCK_TYPES, quantize_q4_0
from npu_draft.factory.shapes import CORE, TARGET_SHAPES, ModelShape
from npu_draft.factory.weights import padded_tensors, random_weights
from tests.support.reference import Qwen3Config, Qwen3Numpy

Q4_0, Q8_0, F32 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32
N_TOKENS = 32


def reference_q4_0(data: np.ndarray) -> np.ndarray:
    return quantize(np.asarray(data, dtype=np.float32), Q4_0)


def test_q4_0_quantizer_is_byte_exact_with_the_reference() -> None:
    rng = np.random.default_rng(0)
    data = (0.1 * rng.standard_normal((64, 1024))).astype(np.float32)
    data[0] = 0  # whole zero rows
    data[1, 64:128] = 0  # zero blocks inside a row
    data[2, :32] = 1e-6 * rng.standard_normal(32)  # scale underflows float16
    data[3, :32] = 3e4 * rng.standard_normal(32)  # large values
    data[4, :32] = np.arange(-16, 16)  # -16 is the largest magnitude: d = 2, q of 15 -> 15
    data[5, :32] = 1.0
    data[5, 7] = -1.0  # equal magnitudes: the first one sets the sign of d
    data[6, :32] = -np.arange(32) / 4  # clamped at 15 on the far side
    expected = reference_q4_0(data)
    assert quantize_q4_0(data).tobytes() == expected.tobytes()
    assert quantize_q4_0(data, threads=1).tobytes() == expected.tobytes()
    half = np.delete(data, 3, axis=0).astype(np.float16)
    assert quantize_q4_0(half).tobytes() == reference_q4_0(half).tobytes()
    zero = BLOCK_TYPES["q4_0"].zero_block()
    assert zero.tobytes() == b"\x00\x80" + b"\x88" * 16  # d = 0 / -8 = -0.0, every q = 8


def test_q4_0_refuses_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_0(np.ones((2, 48), np.float32))


@pytest.mark.parametrize(
    "core",
    [CORE, ModelShape(hidden=48, layers=1, heads=2, kv_heads=1, ffn=96)],
    ids=["core", "unaligned-core"],
)
def test_structured_q4_0_equals_quantizing_every_value(core: ModelShape) -> None:
    big = TARGET_SHAPES["padded-test"]
    checked = 0
    for spec in padded_tensors(random_weights(core, 0), core, big, 0, np.float32):
        if len(spec.shape) == 2:
            fast = spec.make_quantized("q4_0")
            assert fast.tobytes() == reference_q4_0(spec.make()).tobytes(), spec.name
            checked += 1
    assert checked == 2 + 7 * big.layers


async def _post(base_url: str, path: str, body: dict) -> dict:
    async with (
        aiohttp.ClientSession() as session,
        session.post(base_url + path, json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def _greedy(base_url: str, prompt: list[int], n: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
            "samplers": ["top_k"], "return_tokens": True}  # fmt: skip
    return (await _post(base_url, "/completion", body))["tokens"]


@pytest.mark.server
@pytest.mark.parametrize("target_shape", ["small", "padded-test"])
async def test_q4_0_target_loads_and_generates(
    target_shape: str, tmp_path: Path, make_models_dir, start_server, record_property
) -> None:
    target = write_target(
        tmp_path / "target-q4_0.gguf", target_shape=target_shape, target_dtype="q4_0"
    )
    file_type, tensors = read_tensor_types(target)
    assert file_type == 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    assert len(tensors) == 3 + 11 * TARGET_SHAPES[target_shape].layers
    assert tensors["token_embd.weight"][1] == Q4_0
    assert tensors["output.weight"][1] == Q8_0  # llama-quantize: Q6_K (see gguf_out)
    for name, (shape, tensor_type) in tensors.items():
        if name != "output.weight":
            assert tensor_type == (Q4_0 if len(shape) == 2 else F32), name

    quantized = await start_server(target)
    exact = await start_server(make_models_dir("same") / "target.gguf")  # the float core
    core = _core_weights(0, 0.0)
    float_core = _numpy_model(core)
    dequantized_core = _numpy_model(stored_function_weights(core, "q4_0"))
    agreement, float_forced, dequantized_forced = [], [], []
    for text in ["Hello, my name is", "def fibonacci(n):\n    "]:
        prompt = (await _post(exact.base_url, "/tokenize", {"content": text}))["tokens"]
        got = await _greedy(quantized.base_url, prompt, N_TOKENS)
        assert len(got) == N_TOKENS
        assert len(set(got)) >= N_TOKENS // 2, got  # a sensible, non-degenerate continuation
        expected = await _greedy(exact.base_url, prompt, N_TOKENS)
        agreement.append(float(np.mean(np.equal(got, expected))))
        float_forced.append(_teacher_forced(float_core, prompt, got))
        dequantized_forced.append(_teacher_forced(dequantized_core, prompt, got))
    record_property("q4_0_same_position_agreement", agreement)
    record_property("q4_0_teacher_forced_float_core", float_forced)
    record_property("q4_0_teacher_forced_dequantized_core", dequantized_forced)
    print(
        f"Q4_0 {target_shape}: same-position agreement with the float core {agreement}; "
        f"teacher-forced agreement of the float core {float_forced}, of the dequantized "
        f"core (what drafts of a q4_0 target start from) {dequantized_forced}"
    )
    # Drafts of a q4_0 target start from the dequantized core: it must track the target.
    assert np.mean(dequantized_forced) >= 0.85
    assert np.mean(dequantized_forced) > np.mean(float_forced)


def _numpy_model(weights: dict[str, np.ndarray]) -> Qwen3Numpy:
    config = Qwen3Config(
        vocab_size=CORE.vocab,
        hidden_size=CORE.hidden,
        intermediate_size=CORE.ffn,
        num_hidden_layers=CORE.layers,
        num_attention_heads=CORE.heads,
        num_key_value_heads=CORE.kv_heads,
        head_dim=CORE.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    return Qwen3Numpy(config, weights)


def _teacher_forced(model: Qwen3Numpy, prompt: list[int], continuation: list[int]) -> float:
    """Share of positions where the model's argmax is the continuation's next token."""
    tokens = prompt + continuation
    logits = model.forward(tokens[:-1], model.new_cache(len(tokens)))
    predicted = np.argmax(logits[len(prompt) - 1 :], axis=-1)
    return float(np.mean(predicted == np.array(continuation)))
