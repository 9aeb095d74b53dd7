"""Backend choice and the refusals that happen before any model runs."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from npu_draft.load import load_drafter
from npu_draft.onnx_runner import DecoderSpec, OnnxDraftModel
from npu_draft.tokenizer_check import DrafterManifest, TokenizerFacts, TokenizerMismatch

SPEC = DecoderSpec(num_layers=1, num_kv_heads=1, head_dim=4, vocab_size=8, context_length=16)


def write_concat_decoder(folder: Path) -> None:
    """A decoder whose attention concatenates past and new keys (optimum's layout)."""
    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, [1, 1, "p", 4])
    new = helper.make_tensor_value_info("new_key", TensorProto.FLOAT, [1, 1, "n", 4])
    present = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, [1, 1, "t", 4])
    concat = helper.make_node(
        "Concat", ["past_key_values.0.key", "new_key"], ["present.0.key"], axis=2
    )
    graph = helper.make_graph([concat], "decoder", [past, new], [present])
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    DrafterManifest(TokenizerFacts("concat-model", 8), format="onnx", decoder=SPEC.to_json()).write(
        folder
    )


def test_graph_without_shared_buffer_attention_is_refused(tmp_path: Path) -> None:
    write_concat_decoder(tmp_path)
    with pytest.raises(ValueError, match=r"feed \['Concat'\], not GroupQueryAttention"):
        OnnxDraftModel(tmp_path)


def test_folder_without_decoder_description_is_explained(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no genai_config\.json or npu_draft\.json"):
        load_drafter(tmp_path)


def test_target_check_runs_before_loading(tmp_path: Path) -> None:
    write_concat_decoder(tmp_path)  # would be refused later; the tokenizer comes first
    with pytest.raises(TokenizerMismatch, match="'concat-model' and target model 'big'"):
        load_drafter(tmp_path, target=TokenizerFacts("big", 151_936))


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown drafter backend"):
        load_drafter("ngram", backend="tensorrt")


def test_oracle_folder_loads_the_oracle(tmp_path: Path) -> None:
    from npu_draft.oracle import OracleConfig, OracleDraftModel, write_oracle_folder

    write_oracle_folder(tmp_path, [([1, 2, 3], [4, 5, 6])], OracleConfig(acceptance=1.0))
    model = load_drafter(tmp_path, target=TokenizerFacts("qwen-target", 151_936))
    assert isinstance(model, OracleDraftModel)
    session = model.open_session()
    session.sync([1, 2, 3])
    assert session.propose(3).tokens == [4, 5, 6]
    with pytest.raises(TokenizerMismatch, match="vocabulary size 151936 vs 32000"):
        load_drafter(tmp_path, target=TokenizerFacts("llama-target", 32_000))


def test_a_model_folder_is_a_model_whatever_else_it_holds(tmp_path: Path) -> None:
    """The oracle (a benchmark stand-in) is looked for only where no real model is."""
    from npu_draft.oracle import OracleConfig, write_oracle_folder

    write_oracle_folder(tmp_path, [([1, 2, 3], [4, 5, 6])], OracleConfig(acceptance=1.0))
    (tmp_path / "genai_config.json").write_text("{}")
    with pytest.raises(ValueError, match="does not record which tokenizer"):
        load_drafter(tmp_path, target=TokenizerFacts("qwen-target", 151_936))
