"""Cost-padded drafts compute the core draft function: through the real llama-server
(draft.gguf against draft-core.gguf) and through the drafter folder the proxy loads
(draft/, exported from the padded draft, against the exact numpy core draft)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from npu_draft.factory import CORE, DRAFT_SHAPES, make_models
from npu_draft.factory.gguf_out import read_tensor_types
from npu_draft.factory.make import DraftSpec, draft_weights, stored_function_weights
from npu_draft.factory.weights import random_weights
from npu_draft.load import load_drafter
from npu_draft.tokenizer_check import DrafterManifest
from tests.support.reference import ReferenceDraftModel

pytestmark = pytest.mark.server

PROMPTS = [
    "Hello, my name is",
    "def fibonacci(n):\n    ",
    "The capital of France is Paris. The capital of Germany is",
]
N_TOKENS = 48
NEAR_TIE = 1e-3  # top-2 logit gap below which numerics may flip a greedy choice
DRAFT = "noisy:0.03"


@pytest.fixture(scope="module")
def padded_draft_models(tmp_path_factory) -> Path:
    return make_models(
        tmp_path_factory.mktemp("padded-draft") / "models",
        draft=DRAFT,
        draft_shape="padded-test",
    )


async def _post(base_url: str, path: str, body: dict) -> dict:
    async with (
        aiohttp.ClientSession() as session,
        session.post(base_url + path, json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def _greedy(base_url: str, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
            "samplers": ["top_k"], "return_tokens": True, "n_probs": 2,
            "post_sampling_probs": False, "cache_prompt": False}  # fmt: skip
    return await _post(base_url, "/completion", body)


def _first_difference(got: list[int], expected: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            return position
    return None


def test_padded_draft_files_have_the_draft_shape(padded_draft_models: Path) -> None:
    big = DRAFT_SHAPES["padded-test"]
    file_type, tensors = read_tensor_types(padded_draft_models / "draft.gguf")
    assert file_type == 0  # float32: the CI draft stays exact
    assert len(tensors) == 3 + 11 * big.layers
    assert tensors["blk.0.attn_q.weight"][0] == (big.heads * 128, big.hidden)
    assert tensors["blk.0.attn_k.weight"][0] == (big.kv_heads * 128, big.hidden)
    assert tensors["output.weight"] == ((151_936, big.hidden), GGMLQuantizationType.F32)
    _, core_tensors = read_tensor_types(padded_draft_models / "draft-core.gguf")
    assert core_tensors["blk.0.attn_q.weight"][0] == (4 * 128, 256)
    decoder = DrafterManifest.read(padded_draft_models / "draft").decoder
    assert decoder["num_layers"] == big.layers
    assert decoder["num_kv_heads"] == big.kv_heads


async def test_padded_draft_gguf_computes_the_core_draft(
    padded_draft_models: Path, start_server
) -> None:
    padded = await start_server(padded_draft_models / "draft.gguf")
    core = await start_server(padded_draft_models / "draft-core.gguf")
    for text in PROMPTS:
        prompt = (await _post(core.base_url, "/tokenize", {"content": text}))["tokens"]
        expected = await _greedy(core.base_url, prompt, N_TOKENS)
        got = (await _greedy(padded.base_url, prompt, N_TOKENS))["tokens"]
        assert len(set(expected["tokens"])) >= N_TOKENS * 3 // 4  # equality means something
        position = _first_difference(got, expected["tokens"])
        if position is not None:
            top = expected["completion_probabilities"][position]["top_logprobs"][:2]
            gap = abs(top[0]["logprob"] - top[1]["logprob"])
            assert gap < NEAR_TIE, f"{text!r}: differs at {position}, top-2 gap {gap:.4f}"


def test_padded_drafter_folder_computes_the_core_draft(padded_draft_models: Path) -> None:
    drafter = load_drafter(padded_draft_models / "draft", max_context=256)
    reference = ReferenceDraftModel(padded_draft_models / "draft-hf").open_session()
    session = drafter.open_session()
    try:
        tokenizer_prompts = [[9707, 11, 847, 829, 374], [750, 75698, 1445, 982, 262]]
        for prompt in tokenizer_prompts:
            session.sync(prompt)
            got = session.propose(N_TOKENS).tokens
            reference.sync(prompt)
            expected = reference.propose(N_TOKENS).tokens
            assert len(set(expected)) >= N_TOKENS * 3 // 4
            position = _first_difference(got, expected)
            if position is not None:  # only a proven near-tie of the exact reference may flip
                reference.sync(prompt + expected[:position])
                top2 = np.sort(reference.next_logits())[-2:]
                gap = float(top2[1] - top2[0])
                assert gap < NEAR_TIE, f"differs at {position}, top-2 gap {gap:.4f}"
    finally:
        session.close()
        drafter.close()


def test_a_q8_0_draft_hands_its_stored_weights_to_the_drafter(tmp_path: Path) -> None:
    """draft-hf/ (the export's source) holds what the q8_0 draft.gguf computes with."""
    out = make_models(tmp_path / "q8", draft=DRAFT, draft_shape="padded-test",
                      draft_dtype="q8_0", with_drafter=False)  # fmt: skip
    file_type, tensors = read_tensor_types(out / "draft.gguf")
    assert file_type == 7 and tensors["blk.0.ffn_up.weight"][1] == GGMLQuantizationType.Q8_0
    drafted = draft_weights(random_weights(CORE, 0), DraftSpec.parse(DRAFT), 0)
    expected = stored_function_weights(drafted, "q8_0")
    stored = load_file(str(out / "draft-hf" / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    assert np.array_equal(stored[name], expected[name])
    assert not np.array_equal(stored[name], drafted[name])
