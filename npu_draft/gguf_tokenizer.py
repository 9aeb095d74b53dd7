"""tokenizer.json & co from the `tokenizer.*` fields of a Qwen2-vocabulary GGUF, without PyTorch.

transformers converts a GGUF vocabulary with `AutoTokenizer.from_pretrained(...,
gguf_file=...)`, but its GGUF reader imports PyTorch. The conversion itself is a
byte-level BPE built with the `tokenizers` library; this module builds the same one
(same vocabulary spelling, merges, pre-tokenizer split, special and added tokens) from
the fields `gguf_out.read_tokenizer_fields` reads, so the files are the ones
transformers writes (the tests compare them).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# transformers' Qwen2 pre-tokenizer split (models/qwen2/tokenization_qwen2.py)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
MODEL_MAX_LENGTH = int(1e30)  # what transformers records for "no limit"


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_fields(rows: list[list]) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF fields describe (Qwen2 pre-tokenizer only)."""
    fields = {row[0]: row[-1] for row in rows}
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")
    if (model, pre) != ("gpt2", "qwen2"):
        raise ValueError(f"only Qwen2 byte-level vocabularies are converted, not {model}/{pre}")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    # Control tokens (like <|im_end|>) are special; user-defined ones (like <think>) are
    # matched whole but not special. A control token outside the byte alphabet is a
    # llama.cpp mislabel and is skipped, as transformers does.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, types, strict=True)
            if kind == CONTROL and set(token) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED and token in vocab
        ]
    )
    return tokenizer


def write_tokenizer_files(
    rows: list[list], chat_template: str, out: Path, eos_token: str, pad_token: str
) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into `out`."""
    fields = {row[0]: row[-1] for row in rows}
    tokens = fields["tokenizer.ggml.tokens"]
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_from_fields(rows).save(str(out / "tokenizer.json"))
    config = {
        "add_prefix_space": None,
        "backend": "tokenizers",
        "bos_token": None if bos_id is None else tokens[bos_id],
        "eos_token": eos_token,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": pad_token,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)
