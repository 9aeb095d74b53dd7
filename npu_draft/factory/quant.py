"""GGML block quantization (Q8_0, Q4_0) in numpy, byte-exact with ggml's reference rows.

Both types cut a row into blocks of 32 weights and store one float16 scale per block:

- Q8_0 (`quantize_row_q8_0_ref`): d = max|x| / 127, then 32 int8 q = roundf(x / d)
  (half away from zero; computed with the float32 d, as the C reference does, not
  with the float16 one stored). 34 bytes; an all-zero block is 34 zero bytes.
- Q4_0 (`quantize_row_q4_0_ref`): d = m / -8 where m is the value of largest
  magnitude (sign kept, first one on ties), then q = min(15, trunc(x / d + 8.5)),
  packed two per byte: weight j in the low nibble of byte j, weight j + 16 in its
  high nibble. 18 bytes; an all-zero block is d = -0.0 (0 / -8) and every q = 8 (bytes 0x88).

`quantize` works on chunks of blocks in a thread pool (numpy releases the GIL inside
its loops), so a large tensor uses every core.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block, for both types
QK8_0 = QK
Q8_0_BLOCK_BYTES = 2 + QK  # float16 scale + 32 int8
Q4_0_BLOCK_BYTES = 2 + QK // 2  # float16 scale + 32 packed nibbles
# Blocks per work item: 2 MiB of float32 input, small enough to stay in cache.
_CHUNK_BLOCKS = 1 << 14


def _roundf(values: np.ndarray) -> np.ndarray:
    """C roundf in place: half away from zero, exactly (adding 0.5 first would round
    0.49999997 up)."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    magnitude -= whole
    magnitude *= 2
    np.floor(magnitude, out=magnitude)
    magnitude += whole
    np.copysign(magnitude, values, out=magnitude)
    return magnitude


def _q8_0_blocks(blocks: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 blocks [n, 32] into out [n, 34] (uint8)."""
    values = np.abs(blocks)
    d = values.max(axis=1)
    d /= np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    np.multiply(blocks, inverse[:, None], out=values)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = _roundf(values).astype(np.int8).view(np.uint8)


def _q4_0_blocks(blocks: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 blocks [n, 32] into out [n, 18] (uint8)."""
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = largest / np.float32(-8)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    scaled = blocks * inverse[:, None]
    scaled += np.float32(8.5)
    q = np.minimum(np.trunc(scaled), 15).astype(np.uint8)  # scaled >= 0.5: trunc is C's cast
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)


@dataclass(frozen=True)
class BlockType:
    name: str
    block_bytes: int
    quantize_blocks: Callable[[np.ndarray, np.ndarray], None]

    def byte_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The uint8 shape of a tensor's data (the last dimension becomes bytes)."""
        if not shape or shape[-1] % QK:
            raise ValueError(
                f"{self.name.upper()} needs a last dimension that is a multiple of {QK}, "
                f"got {shape}"
            )
        return (*shape[:-1], shape[-1] // QK * self.block_bytes)

    def zero_block(self) -> np.ndarray:
        """The bytes of one all-zero block."""
        out = np.empty((1, self.block_bytes), dtype=np.uint8)
        self.quantize_blocks(np.zeros((1, QK), np.float32), out)
        return out[0]

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """The bytes of an all-zero tensor of `shape`."""
        byte_shape = self.byte_shape(shape)
        out = np.empty((*byte_shape[:-1], byte_shape[-1] // self.block_bytes, self.block_bytes),
                       dtype=np.uint8)  # fmt: skip
        out[...] = self.zero_block()
        return out.reshape(byte_shape)


BLOCK_TYPES = {
    "q8_0": BlockType("q8_0", Q8_0_BLOCK_BYTES, _q8_0_blocks),
    "q4_0": BlockType("q4_0", Q4_0_BLOCK_BYTES, _q4_0_blocks),
}


def quantize(data: np.ndarray, kind: str, threads: int | None = None) -> np.ndarray:
    """`kind` bytes of `data` (any float dtype), shaped `BLOCK_TYPES[kind].byte_shape`."""
    block_type = BLOCK_TYPES[kind]
    data = np.asarray(data)
    out = np.empty(block_type.byte_shape(data.shape), dtype=np.uint8)
    blocks = data.reshape(-1, QK)
    out_blocks = out.reshape(-1, block_type.block_bytes)
    starts = range(0, len(blocks), _CHUNK_BLOCKS)

    def work(start: int) -> None:
        stop = start + _CHUNK_BLOCKS
        chunk = blocks[start:stop].astype(np.float32, copy=False)
        block_type.quantize_blocks(chunk, out_blocks[start:stop])

    workers = min(threads or os.cpu_count() or 1, len(starts))
    if workers <= 1:
        for start in starts:
            work(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, starts))
    return out


def q8_0_byte_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return BLOCK_TYPES["q8_0"].byte_shape(shape)


def quantize_q8_0(data: np.ndarray, threads: int | None = None) -> np.ndarray:
    return quantize(data, "q8_0", threads)


def quantize_q4_0(data: np.ndarray, threads: int | None = None) -> np.ndarray:
    return quantize(data, "q4_0", threads)


def dequantize_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of Q8_0 bytes (for tests and checks)."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, Q8_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(shape)


def dequantize(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of Q8_0 or Q4_0 bytes (gguf's reference dequantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference_dequantize

    ggml_type = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[kind]
    return reference_dequantize(np.asarray(data, np.uint8), ggml_type).reshape(shape)
