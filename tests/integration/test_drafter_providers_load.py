"""Provider selection, the start-up cross-check and backend choice on real drafter folders.

This machine has only the CPU provider, so the NPU path is exercised with it absent:
asking for it must fail at start-up, and an accelerator whose logits differ from
the CPU's (simulated by perturbing the first-step logits) must be refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from npu_draft import providers
from npu_draft.genai import GenaiDraftModel, GenaiDraftSession
from npu_draft.load import load_drafter
from npu_draft.ngram import CombinedDraftModel, NgramDraftModel
from npu_draft.onnx_runner import OnnxDraftModel, OnnxDraftSession
from npu_draft.onnx_writer import float16_copy
from npu_draft.providers import ProviderMismatch, ProviderUnavailable
from npu_draft.tokenizer_check import (
    TokenizerMismatch,
    facts_from_gguf,
    facts_from_hf_folder,
    target_facts,
)

BACKENDS = ["onnx", "genai"]
WITH_CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # listed; this machine has none
# Where each backend's logits come out, and how it builds its CPU reference.
LOGITS_SOURCE = {
    "onnx": (OnnxDraftSession, "_forward", OnnxDraftModel),
    "genai": (GenaiDraftSession, "_read_logits", GenaiDraftModel),
}


@pytest.fixture(scope="module")
def draft_dir(demo_models: Path) -> Path:
    return demo_models / "draft"


@pytest.mark.parametrize("backend", BACKENDS)
def test_npu_requested_but_absent_is_a_startup_error(draft_dir: Path, backend: str) -> None:
    with pytest.raises(ProviderUnavailable) as caught:
        load_drafter(draft_dir, "npu", backend=backend)
    message = str(caught.value)
    assert "VitisAIExecutionProvider" in message and "only offers" in message and "cpu" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_runs_on_cpu_and_says_so(draft_dir: Path, backend: str, caplog) -> None:
    with caplog.at_level(logging.INFO):
        model = load_drafter(draft_dir, "auto", backend=backend, max_context=64)
    assert model.info.provider == "cpu" and model.info.backend == backend
    assert any(f"backend {backend} on cpu" in r.getMessage() for r in caplog.records)


@pytest.mark.filterwarnings("ignore:Specified provider 'VitisAIExecutionProvider'")
def test_provider_that_onnx_runtime_drops_is_refused(draft_dir: Path, monkeypatch) -> None:
    # The NPU listed as available but failing to start: ONNX Runtime falls back to CPU
    # with a warning only; the drafter must not claim to run on the NPU.
    listed = ["VitisAIExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(providers, "available_providers", lambda: listed)
    with pytest.raises(ProviderUnavailable, match="did not start VitisAIExecutionProvider"):
        load_drafter(draft_dir, "auto", backend="onnx", max_context=64)


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_fp32_graph_drafts_on_the_cpu_rather_than_cuda(
    draft_dir: Path, monkeypatch, caplog
) -> None:
    # CUDA listed (this machine has none): ONNX Runtime's CUDA attention takes no fp32,
    # so `auto` keeps an fp32 graph on the CPU; an explicit `cuda` is tried, with the
    # reason in the log (here it then fails to start, as CUDA is not really there)
    monkeypatch.setattr(providers, "available_providers", lambda: WITH_CUDA)
    with caplog.at_level(logging.WARNING):
        model = load_drafter(draft_dir, "auto", backend="onnx", max_context=64)
    assert model.info.provider == "cpu"
    assert any("fp32 graph" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(ProviderUnavailable):
        load_drafter(draft_dir, "cuda", backend="onnx", max_context=64)
    assert any("--precision fp16" in r.getMessage() for r in caplog.records)


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_fp16_copy_keeps_cuda_and_drafts_like_fp32(
    draft_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    half = float16_copy(draft_dir, tmp_path / "draft16")
    assert json.loads((half / "npu_draft.json").read_text())["precision"] == "fp16"
    fp32 = load_drafter(draft_dir, "cpu", backend="onnx", max_context=64)
    fp16 = load_drafter(half, "cpu", backend="onnx", max_context=64)
    prompt = providers.probe_tokens(fp32.info.vocab_size)
    wide, narrow = (first_logits(model, prompt) for model in (fp32, fp16))
    assert np.abs(narrow - wide).max() < 1e-2 * np.abs(wide).max()  # fp16 rounding only
    monkeypatch.setattr(providers, "available_providers", lambda: WITH_CUDA)
    with caplog.at_level(logging.WARNING), pytest.raises(ProviderUnavailable, match="CUDA"):
        load_drafter(half, "auto", backend="onnx", max_context=64)  # auto stays on CUDA
    assert not any("fp32 graph" in r.getMessage() for r in caplog.records)


def first_logits(model, prompt: list[int]) -> np.ndarray:
    session = model.open_session()
    try:
        session.sync(prompt)
        return session.next_logits()
    finally:
        session.close()


def _perturb_first_step(monkeypatch, backend: str) -> None:
    """Make the drafter's own logits wrong while its CPU reference stays honest,
    as a miscompiling accelerator would."""
    session_cls, method, model_cls = LOGITS_SOURCE[backend]
    state = {"broken": True}
    original = getattr(session_cls, method)
    noise = np.random.default_rng(0).normal(0, 0.5, 151_936).astype(np.float32)

    def broken(self, *args):
        logits = original(self, *args)
        return logits + noise if state["broken"] else logits

    original_reference = model_cls._cpu_probe_logits

    def honest_reference(self):
        state["broken"] = False
        try:
            return original_reference(self)
        finally:
            state["broken"] = True

    monkeypatch.setattr(session_cls, method, broken)
    monkeypatch.setattr(model_cls, "_cpu_probe_logits", honest_reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_check_refuses_logits_that_differ_from_cpu(
    draft_dir: Path, backend: str, monkeypatch
) -> None:
    model = load_drafter(draft_dir, "cpu", backend=backend, cross_check=True, max_context=64)
    assert model.info.provider == "cpu"  # unperturbed: the check passes
    _perturb_first_step(monkeypatch, backend)
    with pytest.raises(ProviderMismatch, match="disagree with the CPU provider"):
        load_drafter(draft_dir, "cpu", backend=backend, cross_check=True, max_context=64)


def _genai_copy(draft_dir: Path, tmp_path: Path, provider_options: list) -> Path:
    folder = tmp_path / "draft"
    folder.mkdir()
    for item in draft_dir.iterdir():
        (folder / item.name).symlink_to(item)
    config = json.loads((draft_dir / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = provider_options
    (folder / "genai_config.json").unlink()
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_genai_config_provider_is_used_or_overridden(
    draft_dir: Path, tmp_path: Path, caplog
) -> None:
    folder = _genai_copy(draft_dir, tmp_path, [{"VitisAI": {"config_file": "vaip.json"}}])
    with caplog.at_level(logging.WARNING):
        model = load_drafter(folder, "auto", max_context=64)  # NPU absent: warn, then CPU
    assert model.info.provider == "cpu"
    assert any("asks for provider 'npu'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ProviderUnavailable):
        load_drafter(folder, "npu", max_context=64)
    assert load_drafter(folder, "cpu", max_context=64).info.provider == "cpu"


def test_genai_folder_runs_on_the_onnx_backend_without_genai(
    draft_dir: Path, monkeypatch, caplog
) -> None:
    # a GPU host's onnxruntime-gpu without onnxruntime-genai: the same graph, onnx backend
    monkeypatch.setattr("npu_draft.load.genai_installed", lambda: False)
    with caplog.at_level(logging.INFO):
        model = load_drafter(draft_dir, max_context=64)
    assert isinstance(model, OnnxDraftModel) and model.info.backend == "onnx"
    assert any("onnxruntime-genai is not installed" in r.getMessage() for r in caplog.records)


def test_backend_is_chosen_from_folder_contents(draft_dir: Path, tmp_path: Path) -> None:
    assert isinstance(load_drafter(draft_dir, max_context=64), GenaiDraftModel)
    assert isinstance(load_drafter(draft_dir, backend="onnx", max_context=64), OnnxDraftModel)
    assert isinstance(load_drafter("ngram"), NgramDraftModel)
    combined = load_drafter(f"{draft_dir}+ngram", backend="onnx", max_context=64)
    assert isinstance(combined, CombinedDraftModel) and combined.info.backend == "onnx+ngram"
    with pytest.raises(FileNotFoundError, match=r"neither genai_config\.json nor an \.onnx"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a folder nor"):
        load_drafter(tmp_path / "missing")


def test_tokenizer_of_the_factory_target_matches(demo_models: Path, draft_dir: Path) -> None:
    for target in (
        facts_from_gguf(demo_models / "target.gguf"),
        facts_from_hf_folder(demo_models / "target-hf"),
    ):
        model = load_drafter(draft_dir, target=target, max_context=64)
        assert model.info.vocab_size == target.vocab_size


def test_tokenizer_mismatch_is_refused_naming_both(demo_models: Path, draft_dir: Path) -> None:
    real = facts_from_hf_folder(demo_models / "target-hf")
    assert real.probe_ids is not None
    tokenized_differently = target_facts(
        "other-family-target",
        real.vocab_size,
        real.bos_token_id,
        real.eos_token_ids,
        [*real.probe_ids[:5], 42, *real.probe_ids[6:]],
    )
    with pytest.raises(TokenizerMismatch) as caught:
        load_drafter(draft_dir, target=tokenized_differently, max_context=64)
    message = str(caught.value)
    assert "npu-spec-draft-same-s0" in message and "other-family-target" in message
    assert "from token 5" in message
