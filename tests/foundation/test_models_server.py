"""Factory models against the real pinned llama-server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from tokenizers import Tokenizer

from npu_draft.factory import make_models
from proxy.server.llama_server import LlamaServerProcess
from tests.support.reference import ReferenceDraftModel

pytestmark = pytest.mark.server

PROMPTS = [
    "Hello, my name is",
    "def fibonacci(n):\n    ",
    "The capital of France is Paris. The capital of Germany is",
]
PROBE_TEXTS = [
    *PROMPTS,
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<think>\n\n</think>\n\nnaïve café — 東京 🚀 $x^2$ \t tabs\r\nand  spaces",
    '<tool_call>{"name": "f"}</tool_call><|endoftext|>',
]
# Margin below which two top logits count as a near-tie numerics may flip.
NEAR_TIE = 1e-3


async def post(server: LlamaServerProcess, path: str, body: dict) -> dict:
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.base_url + path, json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def greedy(server: LlamaServerProcess, prompt: list[int], n: int) -> dict:
    return await post(
        server,
        "/completion",
        {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "samplers": ["top_k"],
            "return_tokens": True,
            "n_probs": 2,
            "post_sampling_probs": False,
            "cache_prompt": False,
        },
    )


async def tokenize(server: LlamaServerProcess, text: str, special: bool = True) -> list[int]:
    result = await post(server, "/tokenize", {"content": text, "parse_special": special})
    return result["tokens"]


def top2_gap(step: dict) -> float:
    logits = [entry["logprob"] for entry in step["top_logprobs"][:2]]
    return abs(logits[0] - logits[1])


async def test_server_loads_target_with_real_vocab_and_template(
    demo_models: Path, start_server
) -> None:
    server = await start_server(demo_models / "target.gguf")
    props = await post_get(server, "/props")
    assert "<|im_start|>" in props["chat_template"] and "enable_thinking" in props["chat_template"]
    prompt = await tokenize(server, PROMPTS[0])
    result = await greedy(server, prompt, 64)
    tokens = result["tokens"]
    assert len(tokens) == 64
    # Not degenerate: a random model with the usual small init repeats one token.
    assert len(set(tokens)) >= 48, tokens


async def post_get(server: LlamaServerProcess, path: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(server.base_url + path) as response:
        assert response.status == 200
        return await response.json()


async def test_local_tokenizer_agrees_with_the_server(demo_models: Path, start_server) -> None:
    server = await start_server(demo_models / "target.gguf")
    for folder in ("target-hf", "draft-hf"):
        local = Tokenizer.from_file(str(demo_models / folder / "tokenizer.json"))
        for text in PROBE_TEXTS:
            expected = await tokenize(server, text)
            assert local.encode(text, add_special_tokens=False).ids == expected, text
    assert local.token_to_id("<|im_end|>") == 151645
    assert local.get_vocab_size() == 151936 or local.get_vocab_size() >= 151665


async def test_numpy_reference_matches_the_server(demo_models: Path, start_server) -> None:
    """The exact reference other tests lean on computes what llama-server computes."""
    server = await start_server(demo_models / "target.gguf")
    reference = ReferenceDraftModel(demo_models / "target-hf").open_session()
    for text in PROMPTS[:2]:
        prompt = await tokenize(server, text)
        result = await greedy(server, prompt, 40)
        reference.sync(prompt)
        drafted = reference.propose(40).tokens
        assert_equal_or_near_tie(result, drafted, result["tokens"])


def assert_equal_or_near_tie(result: dict, got: list[int], expected: list[int]) -> None:
    """Token-identical, or the first difference is a proven near-tie of the server's top two."""
    for position, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            gap = top2_gap(result["completion_probabilities"][position])
            assert gap < NEAR_TIE, f"tokens differ at {position} with top-2 gap {gap:.4f}"
            return
    assert len(got) == len(expected)


async def test_padded_target_computes_the_core_function(make_models_dir, start_server) -> None:
    models = make_models_dir("same", target_shape="padded-test")
    padded = await start_server(models / "target.gguf")
    core = await start_server(models / "core.gguf")
    for text in PROMPTS:
        prompt = await tokenize(core, text)
        expected = await greedy(core, prompt, 64)
        got = await greedy(padded, prompt, 64)
        assert len(set(expected["tokens"])) >= 48  # non-repeating, so equality means something
        assert_equal_or_near_tie(expected, got["tokens"], expected["tokens"])


def teacher_forced_agreement(draft_dir: Path, prompt: list[int], target_tokens: list[int]) -> float:
    """Share of positions where the draft's argmax is the target's next token."""
    session = ReferenceDraftModel(draft_dir).open_session()
    hits = 0
    for i, token in enumerate(target_tokens):
        session.sync(prompt + target_tokens[:i])
        hits += int(np.argmax(session.next_logits()) == token)
    return hits / len(target_tokens)


@pytest.mark.parametrize(
    ("draft", "low", "high"),
    [("same", 0.97, 1.0), ("noisy:0.05", 0.35, 0.95), ("unrelated", 0.0, 0.05)],
)
async def test_draft_variant_acceptance_band(
    draft: str, low: float, high: float, make_models_dir, start_server
) -> None:
    models = make_models_dir(draft)
    server = await start_server(models / "target.gguf")
    rates = []
    for text in PROMPTS:
        prompt = await tokenize(server, text)
        target_tokens = (await greedy(server, prompt, 40))["tokens"]
        rates.append(teacher_forced_agreement(models / "draft-hf", prompt, target_tokens))
    agreement = float(np.mean(rates))
    assert low <= agreement <= high, f"{draft}: agreement {agreement:.3f} outside [{low}, {high}]"


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_make_models_is_deterministic(tmp_path: Path, make_models_dir) -> None:
    reference = make_models_dir("noisy:0.05")
    with_drafter = (reference / "draft").is_dir()
    again = make_models(tmp_path / "again", seed=0, draft="noisy:0.05", with_drafter=with_drafter)
    assert _tree_digest(again) == _tree_digest(reference)
    other = make_models(tmp_path / "other", seed=1, draft="noisy:0.05", with_drafter=False)
    assert _tree_digest(other)["target.gguf"] != _tree_digest(reference)["target.gguf"]
