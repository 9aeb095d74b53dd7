"""`doctor --plan` reads a model's KV shape from the GGUF header alone, and gets what
gguf's full reader gets."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from proxy.server.gguf_header import MAX_DECODED_ARRAY, GgufHeaderError, read_metadata
from proxy.server.kv_plan import read_kv_shape


def _full_reader_scalars(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the reader's own header entries
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > MAX_DECODED_ARRAY:
            continue
        fields[name] = value
    return fields


def test_the_header_holds_what_gguf_reads(demo_models: Path) -> None:
    """The demo target: every field but the long vocabulary arrays, equal."""
    target = demo_models / "target.gguf"
    header = read_metadata(target)
    full = _full_reader_scalars(target)
    assert {k: v for k, v in header.items() if v is not None} == full
    skipped = {k for k, v in header.items() if v is None}
    assert skipped == {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    }


def test_per_layer_kv_heads_are_read_as_a_list(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(3)
    writer.add_head_count(8)
    writer.add_head_count_kv([2, 4, 2])
    writer.add_embedding_length(1024)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(MAX_DECODED_ARRAY + 1)])
    writer.add_uint32("after.the.vocabulary", 7)  # read past a skipped array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = read_kv_shape(path)
    assert shape.kv_heads == (2, 4, 2) and shape.key_length == 128 and shape.layers == 3
    assert read_metadata(path)["after.the.vocabulary"] == 7


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GgufHeaderError, match="magic"):
        read_metadata(path)
