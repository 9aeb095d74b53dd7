"""Mirror of llama-server's generated-text bookkeeping, token by token.

`ServerTextState` follows tools/server/server-context.cpp `process_token`: UTF-8
hold-back, stop strings across token boundaries, n_predict and context limits, so the
proxy stops on the same token and returns the same text as the server alone.
`PieceCache` and `align_pieces` recover the exact bytes each token added.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.data.verify import VerifyResult
from proxy.server.upstream import UpstreamClient

log = logging.getLogger(__name__)


# -- text bookkeeping, mirroring tools/server/server-context.cpp process_token ----


def valid_utf8_prefix(data: bytes, *, high_bytes_lead: bool = True) -> int:
    """Length of the longest prefix that does not end inside a UTF-8 sequence.

    Same rule as llama.cpp's `validate_utf8`: only an incomplete multi-byte sequence
    at the very end is cut; invalid bytes elsewhere are left alone. With
    `high_bytes_lead=False` a byte 0xF8-0xFF (never valid UTF-8) does not start a
    sequence, so it is never held back (`align_pieces` relies on that).
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if back == 1 and byte & 0x80 == 0:
            return n
        if byte & 0xC0 == 0xC0:  # a lead byte: does its sequence fit?
            if byte >= 0xF8 and not high_bytes_lead:
                return n
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
            return n if back >= need else n - back
        if byte & 0xC0 != 0x80:
            return n
    return n


def server_utf8_prefix(data: bytes) -> int:
    """llama.cpp's own `validate_utf8` (tools/server/server-common.cpp), byte for byte.

    It looks at the last four bytes whatever they are and cuts at a lead byte whose
    sequence would run past the end, so on invalid UTF-8 it differs from
    `valid_utf8_prefix`: b"\xe2A" is cut to nothing, and 0xF8-0xFF never lead. The
    server holds back streamed text (and skips its stop-string check) exactly when this
    cuts something, so the mirror must use the same rule.
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte & 0xE0 == 0xC0:
            need = 2
        elif byte & 0xF0 == 0xE0:
            need = 3
        elif byte & 0xF8 == 0xF0:
            need = 4
        else:
            continue
        if back < need:
            return n - back
    return n


def find_partial_stop(text: bytes, stop: bytes) -> int:
    """Start of the longest suffix of `text` that is a prefix of `stop`, else -1."""
    if not text or not stop:
        return -1
    last = text[-1]
    for length in range(min(len(text), len(stop)), 0, -1):
        if stop[length - 1] == last and text.endswith(stop[:length]):
            return len(text) - length
    return -1


@dataclass
class TokenEvent:
    """What the server would send for one generated token.

    `sent` is False for a token that ends inside a UTF-8 character: the server
    emits no stream chunk for it. `text` is the newly releasable text (b"" while a
    possible stop string is held back).
    """

    token: int
    text: bytes
    sent: bool
    n_decoded: int
    stopped_by_word: bool = False


class ServerTextState:
    """llama-server's per-slot generated-text state, token by token."""

    def __init__(self, stop_words: Sequence[str], n_prompt: int, n_ctx: int, n_predict: int):
        self.stop_words = [w.encode("utf-8") for w in stop_words]
        self.stop_strings = list(stop_words)
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx
        self.n_predict = n_predict  # -1: unlimited
        self.generated = bytearray()
        self.tokens: list[int] = []
        self.n_sent = 0
        self.stop_type = "none"
        self.stopping_word = ""
        self.truncated = False
        self.has_new_line = False
        self.finished = False

    def _find_stop(self, text: bytes, last_token_size: int, full: bool) -> int:
        best = -1
        for word, word_str in zip(self.stop_words, self.stop_strings, strict=True):
            if full:
                tmp = len(word) + last_token_size
                pos = text.find(word, max(0, len(text) - tmp))
            else:
                pos = find_partial_stop(text, word)
            if pos != -1 and (best == -1 or pos < best):
                if full:
                    self.stop_type = "word"
                    self.stopping_word = word_str
                    self.finished = True
                best = pos
        return best

    def push(self, token: int, piece: bytes, is_eog: bool) -> TokenEvent:
        if self.finished:
            raise RuntimeError("generation already finished")
        self.generated += piece
        self.tokens.append(token)
        event = TokenEvent(token=token, text=b"", sent=False, n_decoded=len(self.tokens))
        incomplete = server_utf8_prefix(bytes(self.generated)) < len(self.generated)
        if not incomplete:
            pos = min(self.n_sent, len(self.generated))
            test = bytes(self.generated[pos:])
            send_text = True
            stop_pos = self._find_stop(test, len(piece), full=True)
            if stop_pos != -1:
                del self.generated[pos + stop_pos :]
                pos = min(self.n_sent, len(self.generated))
                event.stopped_by_word = True
            elif not is_eog:
                send_text = self._find_stop(test, len(piece), full=False) == -1
            if send_text:
                event.text = bytes(self.generated[pos:])
                self.n_sent += len(event.text)
            event.sent = True
        # Context limit (context shift off): the slot's cache holds the prompt and every
        # generated token but this one.
        if self.n_prompt + len(self.tokens) >= self.n_ctx:
            self.truncated = True
            self.stop_type = "limit"
            self.finished = True
        if not self.finished and self.n_predict != -1 and self.n_predict - len(self.tokens) <= 0:
            self.stop_type = "limit"
            self.finished = True
        if b"\n" in event.text:
            self.has_new_line = True
        if is_eog:
            self.stop_type = "eos"
            self.finished = True
        return event

    def remaining(self) -> int | None:
        """Tokens still allowed by n_predict and the context, None when unlimited."""
        limits = [self.n_ctx - self.n_prompt - len(self.tokens)]
        if self.n_predict != -1:
            limits.append(self.n_predict - len(self.tokens))
        return min(limits)


def _renders_as_prefix(data: bytes, text: str) -> bool:
    complete = data[: valid_utf8_prefix(data, high_bytes_lead=False)]
    return text.startswith(complete.decode("utf-8", errors="replace"))


def align_pieces(pieces: Sequence[bytes], text: str) -> list[bytes]:
    """The bytes each token added to the server's generated `text`.

    `pieces` are exact token pieces as `/tokenize` gives them, control tokens (EOG
    included) spelled out; the generation renders those as nothing. The server's text
    has U+FFFD wherever the bytes are not valid UTF-8, so it is compared as decoded.
    """
    out: list[bytes] = []
    data = b""
    for piece in pieces:
        if _renders_as_prefix(data + piece, text) or not piece:
            data += piece
            out.append(piece)
        elif valid_utf8_prefix(piece) == len(piece) and _renders_as_prefix(data, text):
            out.append(b"")  # a control token: whole text the generation leaves out
        else:
            data += piece
            out.append(piece)
    if data.decode("utf-8", errors="replace") != text:
        log.warning("plain run: token pieces do not spell the server's text; kept as is")
    return out


class PieceCache:
    """Exact bytes of token pieces; the verify result's text is lossy only for
    tokens that end inside a UTF-8 character, and those are looked up once.
    Sampling mode also needs to know which tokens end generation (EOG)."""

    def __init__(self, upstream: UpstreamClient) -> None:
        self._upstream = upstream
        self._exact: dict[int, bytes] = {}
        self._eog: frozenset[int] | None = None

    async def eog_tokens(self) -> frozenset[int]:
        """The server's end-of-generation ids, asked once per process."""
        if self._eog is None:
            self._eog = await self._upstream.eog_tokens()
        return self._eog

    async def token_piece(self, token: int) -> bytes:
        cached = self._exact.get(token)
        if cached is None:
            cached = await self._upstream.token_bytes(token)
            self._exact[token] = cached
        return cached

    async def run_pieces(self, tokens: Sequence[int], text: str) -> list[bytes]:
        """What each token of a plain run added to the server's `text`; the pieces not
        known yet are looked up in one request."""
        unknown = sorted({t for t in tokens if t not in self._exact})
        if unknown:
            pieces = await self._upstream.tokens_bytes(unknown)
            self._exact.update(zip(unknown, pieces, strict=True))
        return align_pieces([self._exact[t] for t in tokens], text)

    async def piece(self, result: VerifyResult) -> bytes:
        if "\ufffd" not in result.piece:
            return result.piece.encode("utf-8")
        return await self.token_piece(result.token)
