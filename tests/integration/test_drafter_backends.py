"""The `onnx` and `genai` backends on the factory's draft model, against Hugging Face
transformers running the same weights, and against their own fresh prefill."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from npu_draft.async_session import AsyncDraftSession
from npu_draft.load import load_drafter
from npu_draft.ngram import CombinedDraftModel
from npu_draft.onnx_runner import OnnxDraftModel
from npu_draft.protocol import CancelToken, DraftCancelled, DraftModel, SamplingParams
from npu_draft.sampling import sampling_distribution

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BACKENDS = ["onnx", "genai"]
# fp32 graph vs fp32 PyTorch: differences are accumulation order only.
LOGITS_TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def hf_draft(demo_models: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        demo_models / "draft-hf", dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module", params=BACKENDS)
def drafter(request, demo_models: Path) -> Iterator[DraftModel]:
    model = load_drafter(demo_models / "draft", backend=request.param, max_context=256)
    yield model
    model.close()


def hf_logits(hf_model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0, -1].numpy()


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        result = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = hf_model(torch.tensor([[token]]), cache=result.cache, use_cache=True)
    return out


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 151_000, length).tolist()


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_drafts_equal_hugging_face(drafter: DraftModel, hf_draft, seed: int) -> None:
    prompt = random_prompt(seed, 17 + seed)
    expected = hf_greedy(hf_draft, prompt, 24)
    assert len(set(expected)) > 12  # a degenerate repeating model would prove little
    session = drafter.open_session()
    session.sync(prompt)
    draft = session.propose(24)
    assert draft.tokens == expected
    assert list(session.tokens) == prompt + expected
    # probs are the plain softmax of the chosen token, as transformers computes it
    first = torch.softmax(torch.tensor(hf_logits(hf_draft, prompt), dtype=torch.float64), -1)
    assert draft.probs[0] == pytest.approx(float(first[expected[0]]), rel=1e-3)


def test_drafts_continue_across_rounds(drafter: DraftModel, hf_draft) -> None:
    prompt = random_prompt(5, 12)
    expected = hf_greedy(hf_draft, prompt, 12)
    session = drafter.open_session()
    session.sync(prompt)
    got: list[int] = []
    for _ in range(3):  # accept all 4 each round; no bonus
        draft = session.propose(4)
        got += draft.tokens
        session.sync(prompt + got)
    assert got == expected


def resync_cases(prompt: list[int], drafted: list[int]) -> list[tuple[str, list[int]]]:
    other = [(t + 1000) % 151_000 for t in drafted]
    return [
        ("accept none", [*prompt, other[0]]),
        ("accept some", [*prompt, *drafted[:2], other[2]]),
        ("accept all + bonus", [*prompt, *drafted, other[0]]),
        ("same again", [*prompt, *drafted, other[0]]),
        ("extend", [*prompt, *drafted, other[0], *other[1:4]]),
        ("rollback into prompt", prompt[:9]),
        ("rollback then diverge", [*prompt[:5], *other]),
        ("back to a prefix", prompt[:5]),
        ("only the first token shared", [prompt[0], *other[:2]]),
        ("nothing shared", other[:3]),
    ]


def test_logits_after_every_resync_equal_fresh_prefill(drafter: DraftModel, hf_draft) -> None:
    prompt = random_prompt(7, 30)
    session = drafter.open_session()
    session.sync(prompt)
    drafted = session.propose(5).tokens
    previous = list(session.tokens)
    for name, tokens in resync_cases(prompt, drafted):
        stats = session.sync(tokens)
        got = session.next_logits()
        fresh = drafter.open_session()
        fresh.sync(tokens)
        np.testing.assert_allclose(got, fresh.next_logits(), **LOGITS_TOL, err_msg=name)
        np.testing.assert_allclose(got, hf_logits(hf_draft, tokens), **LOGITS_TOL, err_msg=name)
        fresh.close()
        # O(new tokens): everything shared is reused, at most one token re-fed
        shared = next(
            (i for i, (a, b) in enumerate(zip(previous, tokens, strict=False)) if a != b),
            min(len(previous), len(tokens)),
        )
        assert stats.reused + stats.appended == len(tokens), name
        assert stats.appended <= len(tokens) - shared + 1, name
        assert list(session.tokens) == tokens
        previous = tokens
        # a draft after every pattern continues from the synced sequence
        expected_next = int(np.argmax(got))
        assert session.propose(1).tokens == [expected_next], name
        previous = list(session.tokens)


def test_chunked_prefill_equals_hugging_face(demo_models: Path, hf_draft) -> None:
    model = OnnxDraftModel(demo_models / "draft", max_context=128, prefill_chunk=7)
    session = model.open_session()
    prompt = random_prompt(8, 30)  # 5 chunks, the last one short
    session.sync(prompt)
    np.testing.assert_allclose(session.next_logits(), hf_logits(hf_draft, prompt), **LOGITS_TOL)
    session.sync([*prompt, *random_prompt(9, 12)])  # a re-sync that spans chunks too
    np.testing.assert_allclose(
        session.next_logits(), hf_logits(hf_draft, list(session.tokens)), **LOGITS_TOL
    )


def test_sampling_mode_returns_the_distribution_it_drew_from(drafter: DraftModel) -> None:
    prompt = random_prompt(9, 20)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    session = drafter.open_session()
    session.sync(prompt)
    draft = session.propose(4, params, np.random.default_rng(0))
    assert draft.dists is not None and len(draft.dists) == len(draft.tokens) == 4
    fresh = drafter.open_session()
    context = list(prompt)
    for token, prob, dist in zip(draft.tokens, draft.probs, draft.dists, strict=True):
        fresh.sync(context)
        expected = sampling_distribution(fresh.next_logits(), params)
        assert set(dist.ids.tolist()) == set(expected.ids.tolist())
        assert prob == pytest.approx(expected.prob_of(token), rel=1e-3)
        assert dist.probs.sum() == pytest.approx(1.0)
        context.append(token)
    # same seed, same draft
    session.sync(prompt)
    assert session.propose(4, params, np.random.default_rng(0)).tokens == draft.tokens


def test_context_limit_shortens_the_draft(drafter: DraftModel) -> None:
    limit = drafter.info.max_context
    session = drafter.open_session()
    session.sync(random_prompt(11, limit - 3))
    assert len(session.propose(8)) == 3
    with pytest.raises(ValueError, match="exceeds the drafter's context"):
        session.sync(random_prompt(11, limit + 1))


def test_cancelled_token_stops_before_drafting(drafter: DraftModel) -> None:
    session = drafter.open_session()
    session.sync(random_prompt(12, 8))
    token = CancelToken()
    token.cancel()
    assert session.propose(5, cancel=token).tokens == []


def test_drafter_info(drafter: DraftModel, demo_models: Path) -> None:
    info = drafter.info
    assert (info.provider, info.vocab_size, info.max_context) == ("cpu", 151_936, 256)
    assert 151_645 in info.eos_token_ids and info.bos_token_id == 151_643
    assert info.tokenizer_fingerprint is not None


async def test_async_session_drives_the_real_backend(drafter: DraftModel, hf_draft) -> None:
    prompt = random_prompt(14, 15)
    expected = hf_greedy(hf_draft, prompt, 8)
    session = AsyncDraftSession(drafter.open_session())
    await session.sync(prompt)
    first = await session.propose(4)
    await session.sync([*prompt, *first.tokens])  # all accepted, no bonus
    second = await session.propose(4)
    assert [*first.tokens, *second.tokens] == expected
    token = CancelToken()
    token.cancel()
    with pytest.raises(DraftCancelled):
        await session.propose(4, cancel=token)
    await session.sync(prompt)
    np.testing.assert_allclose(
        await session.next_logits(), hf_logits(hf_draft, prompt), **LOGITS_TOL
    )
    await session.close()


def test_combined_drafter_uses_lookup_on_repeats_and_model_otherwise(
    drafter: DraftModel, hf_draft
) -> None:
    combined = CombinedDraftModel(drafter, ngram_sizes=(3,), min_ngram_tokens=3)
    assert combined.info.backend == f"{drafter.info.backend}+ngram"
    session = combined.open_session()
    fresh = random_prompt(13, 10)
    session.sync(fresh)
    assert session.propose(4).tokens == hf_greedy(hf_draft, fresh, 4)
    assert session.last_source == "model"
    repeating = [*fresh, 7, 8, 9, 10, 11, 12, *fresh[:2], 7, 8, 9]
    session.sync(repeating)
    assert session.propose(3).tokens == [10, 11, 12]
    assert session.last_source == "ngram"
    # the model catches up with the accepted tokens and still matches a fresh prefill
    session.sync([*repeating, 10, 11])
    np.testing.assert_allclose(
        session.next_logits(), hf_logits(hf_draft, [*repeating, 10, 11]), **LOGITS_TOL
    )
