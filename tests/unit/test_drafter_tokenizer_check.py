"""Tokenizer facts, their comparison, and the drafter manifest."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from npu_draft.tokenizer_check import (
    PROBE_TEXT,
    DrafterManifest,
    TokenizerFacts,
    TokenizerMismatch,
    check_tokenizer_match,
    target_facts,
)

DRAFT = TokenizerFacts(
    name="qwen3-draft",
    vocab_size=151_936,
    bos_token_id=151_643,
    eos_token_ids=(151_645, 151_643),
    probe_ids=(151_644, 872, 198, 42),
)


def test_identical_facts_match() -> None:
    check_tokenizer_match(DRAFT, replace(DRAFT, name="qwen3-target"))


def test_target_with_fewer_eos_ids_matches() -> None:
    check_tokenizer_match(DRAFT, target_facts("t", 151_936, 151_643, [151_645], DRAFT.probe_ids))


def test_unknown_facts_are_skipped() -> None:
    check_tokenizer_match(DRAFT, TokenizerFacts("t", None))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"vocab_size": 32_000}, "vocabulary size 151936 vs 32000"),
        ({"bos_token_id": 1}, "BOS id 151643 vs 1"),
        ({"eos_token_ids": (2,)}, "EOS ids"),
        ({"probe_ids": (151_644, 872, 199, 42)}, "probe text tokenizes differently from token 2"),
    ],
)
def test_mismatch_names_both_models(change: dict, reason: str) -> None:
    target = replace(DRAFT, name="llama-target", **change)
    with pytest.raises(TokenizerMismatch) as caught:
        check_tokenizer_match(DRAFT, target)
    message = str(caught.value)
    assert "'qwen3-draft'" in message and "'llama-target'" in message and reason in message


def test_fingerprint_tracks_the_facts_not_the_name() -> None:
    assert DRAFT.fingerprint == replace(DRAFT, name="other").fingerprint
    assert DRAFT.fingerprint != replace(DRAFT, probe_ids=(1, 2)).fingerprint
    assert DRAFT.fingerprint != replace(DRAFT, vocab_size=151_937).fingerprint


def test_manifest_round_trip(tmp_path: Path) -> None:
    manifest = DrafterManifest(DRAFT, format="onnx", precision="int4", decoder={"num_layers": 2})
    manifest.write(tmp_path)
    back = DrafterManifest.read(tmp_path)
    assert back is not None
    assert (back.format, back.precision, back.decoder) == ("onnx", "int4", {"num_layers": 2})
    assert back.tokenizer.probe_ids == DRAFT.probe_ids
    assert back.tokenizer.fingerprint == DRAFT.fingerprint
    assert DrafterManifest.read(tmp_path / "missing") is None


def test_probe_recorded_against_another_text_is_not_compared(tmp_path: Path) -> None:
    data = DRAFT.to_json()
    data["probe_text"] = PROBE_TEXT + " changed"
    assert TokenizerFacts.from_json(data).probe_ids is None
