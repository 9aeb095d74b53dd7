"""`npu-spec export-drafter`: formats, precision, determinism, the CLI, and the
tokenizer record that lets loading refuse a drafter made for another vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from npu_draft.export import ExportError, export_drafter
from npu_draft.load import load_drafter
from npu_draft.onnx_runner import OnnxDraftModel
from npu_draft.tokenizer_check import DrafterManifest, TokenizerMismatch, facts_from_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_VOCAB = 4096


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A Qwen3 checkpoint of another vocabulary (no tokenizer files), wide init."""
    folder = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    config = transformers.Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 1.0 if "embed" in name else 0.15)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_onnx(tiny_hf: Path, tmp_path_factory) -> Path:
    return export_drafter(tiny_hf, tmp_path_factory.mktemp("out") / "drafter", fmt="onnx")


def test_onnx_format_is_a_plain_decoder_equal_to_hugging_face(tiny_hf: Path, tiny_onnx: Path):
    assert not (tiny_onnx / "genai_config.json").exists()
    manifest = DrafterManifest.read(tiny_onnx)
    assert manifest is not None and manifest.format == "onnx" and manifest.precision == "fp32"
    assert manifest.decoder["num_layers"] == 2 and manifest.decoder["head_dim"] == 32
    assert manifest.tokenizer.vocab_size == TINY_VOCAB

    model = load_drafter(tiny_onnx, max_context=128)
    assert isinstance(model, OnnxDraftModel) and model.info.max_context == 128
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    prompt = np.random.default_rng(0).integers(3, TINY_VOCAB, 9).tolist()
    session = model.open_session()
    session.sync(prompt)
    draft = session.propose(20)
    with torch.no_grad():
        full = hf(torch.tensor([prompt + draft.tokens])).logits[0].numpy()
    expected = full[len(prompt) - 1 : -1].argmax(-1).tolist()  # teacher-forced greedy
    assert draft.tokens == expected
    np.testing.assert_allclose(session.next_logits(), full[-1], rtol=1e-4, atol=1e-4)


def logits_positions(folder: Path) -> int | str:
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dim = next(o for o in graph.output if o.name == "logits").type.tensor_type.shape.dim[1]
    return dim.dim_value or dim.dim_param


def test_int4_genai_export_is_quantized_and_close(tiny_hf: Path, tiny_onnx: Path, tmp_path):
    # Untrimmed head here (logits for every position), trimmed in tiny_onnx: both
    # graph shapes run, and must agree up to quantization.
    folder = export_drafter(
        tiny_hf, tmp_path / "int4", fmt="genai", precision="int4", last_position_logits=False
    )
    assert logits_positions(folder) == "sequence_length" and logits_positions(tiny_onnx) == 1
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert any(node.op_type == "MatMulNBits" for node in graph.node)
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["search"]["max_length"] == config["model"]["context_length"] == 1024
    prompt = np.random.default_rng(1).integers(3, TINY_VOCAB, 12).tolist()
    logits = {}
    for name, path, backend in (("int4", folder, "genai"), ("fp32", tiny_onnx, "onnx")):
        session = load_drafter(path, backend=backend, max_context=64).open_session()
        session.sync(prompt)
        logits[name] = session.next_logits()
    assert not np.allclose(logits["int4"], logits["fp32"], atol=1e-4)  # really quantized
    # 4-bit blocks of 32 on a 64-wide model are coarse; a broken graph would be ~0
    assert np.corrcoef(logits["int4"], logits["fp32"])[0, 1] > 0.8


def test_drafter_for_another_vocabulary_is_refused(tiny_onnx: Path, demo_models: Path) -> None:
    with pytest.raises(TokenizerMismatch) as caught:
        load_drafter(tiny_onnx, target=facts_from_gguf(demo_models / "target.gguf"))
    message = str(caught.value)
    assert "tiny-qwen3" in message and "target.gguf" in message
    assert f"vocabulary size {TINY_VOCAB} vs 151936" in message


def test_factory_drafter_records_the_qwen_tokenizer(demo_models: Path) -> None:
    manifest = DrafterManifest.read(demo_models / "draft")
    assert manifest is not None and manifest.format == "genai"
    facts = manifest.tokenizer
    assert (facts.vocab_size, facts.bos_token_id) == (151_936, 151_643)
    assert 151_645 in facts.eos_token_ids
    assert facts.probe_ids is not None and 151_644 in facts.probe_ids  # <|im_start|> parsed


def test_cli_export_is_deterministic_and_refuses_to_overwrite(
    tiny_hf: Path, tiny_onnx: Path, tmp_path: Path, capsys
) -> None:
    from proxy.cli import main

    out = tmp_path / "cli"
    assert main(["export-drafter", str(tiny_hf), str(out), "--format", "onnx"]) == 0
    names = sorted(p.name for p in tiny_onnx.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:  # same input, same bytes
        assert (tiny_onnx / name).read_bytes() == (out / name).read_bytes(), name
    assert main(["export-drafter", str(tiny_hf), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_bad_inputs_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="not a Hugging Face checkpoint"):
        export_drafter(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="unknown format"):
        export_drafter(tmp_path, tmp_path / "out", fmt="gguf")
    with pytest.raises(ValueError, match="unknown precision"):
        export_drafter(tmp_path, tmp_path / "out", precision="int8")


def test_export_max_context_is_honoured_and_foreign_folders_are_capped(
    demo_models: Path, tmp_path: Path
) -> None:
    """A 4k prompt needs a drafter sized past 4,096 tokens; folders we did not export
    keep the NPU-safe 4k cap because their KV buffers are allocated up front."""
    long = export_drafter(demo_models / "draft-hf", tmp_path / "long", max_context=8192)
    for backend in ("onnx", "genai"):
        model = load_drafter(long, "cpu", backend=backend)
        assert model.info.max_context == 8192, backend
        model.close()
    (long / "npu_draft.json").unlink()  # now it looks like a third-party folder
    model = load_drafter(long, "cpu", backend="genai")
    assert model.info.max_context == 4096
    model.close()
