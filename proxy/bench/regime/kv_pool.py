"""KV cells as b11434's llama_kv_cache keeps them, for what a decode attends over.

Only placement matters here (no tensors): which cells each sequence (slot) holds, where
the search for free cells starts (`head`), and the span a decode attends over. With
`-kvu` all sequences share one stream of `-c` cells; without it each sequence has its
own stream of `-c / -np` cells. Rules from src/llama-kv-cache.cpp:

- find_slot (non-contiguous): from the stream's head, or from 0 when the head is more
  than `used + 2 * n_tokens` (enough free cells before it), take free cells one by one,
  wrapping at the end; fail when none is left.
- apply_ubatch: the head moves past the last cell used.
- seq_rm: frees the sequence's cells at positions >= p0; the head moves back to the
  first freed cell if that lies before it.
- get_n_kv: the span a decode attends over is used_max_p1 padded up to 256 (at least
  256, at most the stream's size), masked or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_PAD = 256


def padded_span(cells: float) -> int:
    """The span a decode attends over when `cells` are in use (at least N_PAD), before
    the stream's size caps it."""
    return max(N_PAD, -(-int(cells) // N_PAD) * N_PAD)


class KvFull(RuntimeError):
    """No free cells left for a micro-batch (llama_decode returns 1)."""


@dataclass
class _Stream:
    owner: np.ndarray  # seq id per cell, -1 = free
    pos: np.ndarray  # position per cell
    head: int = 0

    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.owner >= 0))

    def used_max_p1(self) -> int:
        taken = np.flatnonzero(self.owner >= 0)
        return int(taken[-1]) + 1 if taken.size else 0


class KvPool:
    def __init__(self, n_ctx: int, n_seq: int, unified: bool) -> None:
        self.unified = unified
        self.n_seq = n_seq
        n_streams = 1 if unified else n_seq
        size = n_ctx if unified else max(n_ctx // n_seq, 1)
        self.streams = [
            _Stream(np.full(size, -1, dtype=np.int32), np.zeros(size, dtype=np.int64))
            for _ in range(n_streams)
        ]

    def _stream(self, seq: int) -> _Stream:
        return self.streams[0 if self.unified else seq]

    @property
    def stream_size(self) -> int:
        return int(self.streams[0].owner.size)

    def free_cells(self, seq: int = 0) -> int:
        stream = self._stream(seq)
        return int(stream.owner.size) - stream.used

    def cells_of(self, seq: int) -> int:
        return int(np.count_nonzero(self._stream(seq).owner == seq))

    def add(self, seq: int, first_pos: int, n_tokens: int) -> None:
        """Place positions first_pos.. of `seq` (find_slot + apply_ubatch)."""
        stream = self._stream(seq)
        size = stream.owner.size
        if n_tokens > size:
            raise KvFull(f"{n_tokens} tokens > {size} cells")
        head = stream.head
        if head > stream.used + 2 * n_tokens:
            head = 0
        free_after = np.flatnonzero(stream.owner[head:] < 0) + head
        free_before = np.flatnonzero(stream.owner[:head] < 0)
        cells = np.concatenate([free_after, free_before])[:n_tokens]
        if cells.size < n_tokens:
            raise KvFull(f"no room for {n_tokens} tokens of sequence {seq}")
        stream.owner[cells] = seq
        stream.pos[cells] = np.arange(first_pos, first_pos + n_tokens)
        stream.head = int(cells[-1]) + 1

    def remove(self, seq: int, from_pos: int = 0) -> None:
        """Free the cells of `seq` at positions >= from_pos (seq_rm)."""
        stream = self._stream(seq)
        freed = np.flatnonzero((stream.owner == seq) & (stream.pos >= from_pos))
        if freed.size:
            stream.owner[freed] = -1
            stream.head = min(stream.head, int(freed[0]))

    def n_kv(self, seq: int) -> int:
        """The span a decode of `seq`'s stream attends over (get_n_kv)."""
        stream = self._stream(seq)
        return min(stream.owner.size, padded_span(stream.used_max_p1()))
