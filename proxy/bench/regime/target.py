"""The regime server's target: llama.cpp's real Qwen2/Qwen3 vocabulary and chat template,
and a scripted greedy "model" whose next token is a pure function of the context.

Output tokens come from a fixed set of ordinary tokens whose text is whole UTF-8 and
holds no control token, so greedy output never ends early (stop type "limit") and no
streamed token ends inside a character. The function mixes the last few tokens with
the position, so a continuation does not fall into a loop, and the same context always
gives the same token, in any slot and any batch: greedy equality checks hold exactly as
they do against llama-server.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from npu_draft.gguf_tokenizer import bytes_to_unicode
from npu_draft.oracle import _MASK64
from npu_draft.oracle import _mix64 as mix64  # the oracle's platform-independent hash

WINDOW = 6  # context tokens the next token depends on, with the position


class ScriptedTarget:
    def __init__(self, tokenizer_dir: Path, seed: int = 0) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        template = tokenizer_dir / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else None
        self.seed = seed
        self.n_vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special = {
            token.content: index
            for index, token in self.tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        self._pieces: list[bytes] = self._all_pieces()

    def _all_pieces(self) -> list[bytes]:
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        pieces = []
        for index in range(self.n_vocab):
            if index in added:
                pieces.append(added[index].encode())
                continue
            text = self.tokenizer.id_to_token(index) or ""
            pieces.append(bytes(byte_of.get(c, 0) for c in text))
        return pieces

    @cached_property
    def output_ids(self) -> np.ndarray:
        """Ordinary tokens of whole UTF-8 text, without control characters."""
        ids = []
        added = set(self.tokenizer.get_added_tokens_decoder())
        for index, piece in enumerate(self._pieces):
            if index in added or not piece:
                continue
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.isprintable() or text.strip(" \n") == "":
                ids.append(index)
        return np.array(ids, dtype=np.int64)

    @property
    def eog_ids(self) -> list[int]:
        return [self.special[t] for t in ("<|endoftext|>", "<|im_end|>") if t in self.special]

    # -- the model ----------------------------------------------------------------

    def next_token(self, context: Sequence[int]) -> int:
        h = mix64(self.seed ^ len(context))
        for token in context[-WINDOW:]:
            h = mix64(h ^ (int(token) & _MASK64))
        return int(self.output_ids[h % len(self.output_ids)])

    # -- text ---------------------------------------------------------------------

    def piece(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < self.n_vocab else b""

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def tokenize(self, text: str, parse_special: bool = True) -> list[int]:
        self.tokenizer.encode_special_tokens = not parse_special
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        finally:
            self.tokenizer.encode_special_tokens = False

    def tokenize_mixed(self, content: Any, parse_special: bool = True) -> list[int]:
        """A prompt as llama-server takes it: text, token ids, or a list mixing both."""
        if isinstance(content, str):
            return self.tokenize(content, parse_special)
        out: list[int] = []
        for item in content:
            if isinstance(item, str):
                out += self.tokenize(item, parse_special)
            elif isinstance(item, int) and not isinstance(item, bool):
                out.append(item)
            else:
                raise ValueError("a prompt holds text and token ids only")
        return out

    def apply_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this vocabulary has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True, **kwargs)
