"""GGML Q8_0 quantization in numpy, byte-exact with ggml's `quantize_row_q8_0_ref`.

A Q8_0 block holds 32 weights as one float16 scale d = max|x| / 127 followed by
32 int8 values q = roundf(x / d) (half away from zero; computed with the float32
d, as the C reference does, not with the float16 one stored). An all-zero block
is 34 zero bytes, so zero padding needs no arithmetic at all.

`quantize_q8_0` works on chunks of blocks in a thread pool (numpy releases the
GIL inside its loops), so a large tensor uses every core.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK8_0 = 32  # weights per block
Q8_0_BLOCK_BYTES = 2 + QK8_0  # float16 scale + 32 int8
# Blocks per work item: 2 MiB of float32 input, small enough to stay in cache.
_CHUNK_BLOCKS = 1 << 14


def q8_0_byte_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 shape of a tensor's Q8_0 data (the last dimension becomes bytes)."""
    if not shape or shape[-1] % QK8_0:
        raise ValueError(f"Q8_0 needs a last dimension that is a multiple of {QK8_0}, got {shape}")
    return (*shape[:-1], shape[-1] // QK8_0 * Q8_0_BLOCK_BYTES)


def _quantize_blocks(blocks: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 blocks [n, 32] into out [n, 34] (uint8)."""
    values = np.abs(blocks)
    d = values.max(axis=1)
    d /= np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    np.multiply(blocks, inverse[:, None], out=values)
    # roundf: half away from zero, exactly (adding 0.5 first would round 0.49999997 up).
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    magnitude -= whole
    magnitude *= 2
    np.floor(magnitude, out=magnitude)
    magnitude += whole
    np.copysign(magnitude, values, out=magnitude)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = magnitude.astype(np.int8).view(np.uint8)


def quantize_q8_0(data: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Q8_0 bytes of `data` (any float dtype), shaped `q8_0_byte_shape(data.shape)`."""
    data = np.asarray(data)
    out = np.empty(q8_0_byte_shape(data.shape), dtype=np.uint8)
    blocks = data.reshape(-1, QK8_0)
    out_blocks = out.reshape(-1, Q8_0_BLOCK_BYTES)
    starts = range(0, len(blocks), _CHUNK_BLOCKS)

    def work(start: int) -> None:
        stop = start + _CHUNK_BLOCKS
        chunk = blocks[start:stop].astype(np.float32, copy=False)
        _quantize_blocks(chunk, out_blocks[start:stop])

    workers = min(threads or os.cpu_count() or 1, len(starts))
    if workers <= 1:
        for start in starts:
            work(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, starts))
    return out


def dequantize_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of Q8_0 bytes (for tests and checks)."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, Q8_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(shape)
