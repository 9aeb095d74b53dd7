"""A GGUF file's metadata, read from its header alone.

`gguf.GGUFReader` also maps every tensor and turns each array field (the
vocabulary: hundreds of thousands of strings) into numpy parts, which takes seconds;
the plan needs a few numbers from the header. Long arrays are skipped, not decoded.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
# value type id -> struct format of one value (GGUF spec, gguf_type)
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
MAX_DECODED_ARRAY = 4096  # longer arrays (vocabularies, merges) are skipped


class GgufHeaderError(ValueError):
    """The file is not a GGUF file this reader understands."""


def read_metadata(path: Path) -> dict[str, object]:
    """Every key of the header; arrays longer than MAX_DECODED_ARRAY map to None."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != MAGIC:
            raise GgufHeaderError(f"{path} does not start with GGUF's magic bytes")
        version, _tensors, n_keys = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise GgufHeaderError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        reader = _Reader(data, 24)
        metadata: dict[str, object] = {}
        for _ in range(n_keys):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        return metadata


class _Reader:
    def __init__(self, data: mmap.mmap, offset: int) -> None:
        self.data = data
        self.offset = offset

    def scalar(self, fmt: str) -> object:
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.data, self.offset)
        start = self.offset + 8
        self.offset = start + length
        return self.data[start : self.offset].decode("utf-8", errors="replace")

    def value(self, kind: object) -> object:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise GgufHeaderError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[object] | None:
        item_kind, count = struct.unpack_from("<IQ", self.data, self.offset)
        self.offset += 12
        if count <= MAX_DECODED_ARRAY:
            return [self.value(item_kind) for _ in range(count)]
        if item_kind in _SCALARS:  # fixed size: one jump
            self.offset += count * struct.calcsize(_SCALARS[item_kind])
        elif item_kind == _STRING:  # each string says its own length
            unpack, data, offset = struct.unpack_from, self.data, self.offset
            for _ in range(count):
                offset += 8 + unpack("<Q", data, offset)[0]
            self.offset = offset
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self.value(item_kind)
        return None
