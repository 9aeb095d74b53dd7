"""What verification costs in KV memory: the llama-server flags for a model, k and
context, and the KV cache they allocate, read from the GGUF's own metadata.

Every conversation holds k+1 slots, each able to hold the whole context (docs/QUICKSTART.md §3),
plus the pass-through slots; llama.cpp allocates, per cell and per layer, K and V rows
of kv_heads x head_dim values in the cache types (f16 unless -ctk/-ctv say otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proxy.server.gguf_header import read_metadata
from proxy.server.managed import ServerLayout, verification_flags

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class KvShape:
    """What the KV cache of one model holds per cell (token)."""

    architecture: str
    layers: int
    kv_heads: tuple[int, ...]  # per layer (llama.cpp allows them to differ)
    key_length: int
    value_length: int
    sliding_window: int | None

    def cell_bytes(self, type_k: str = "f16", type_v: str = "f16") -> float:
        k, v = type_bytes(type_k), type_bytes(type_v)
        return sum(heads * (self.key_length * k + self.value_length * v) for heads in self.kv_heads)


# llama.cpp's KV cache types (common/arg.cpp kv_cache_types) -> (values per block,
# bytes per block), as ggml's type traits give them
CACHE_TYPES = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}  # fmt: skip


def type_bytes(name: str) -> float:
    """Bytes per value of a llama.cpp cache type (f16, bf16, f32, q8_0, q4_0, ...)."""
    try:
        block, size = CACHE_TYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown KV cache type {name!r}; one of {', '.join(CACHE_TYPES)}"
        ) from None
    return size / block


def read_kv_shape(model: Path) -> KvShape:
    """The KV shape from the GGUF header alone (no tensor data, no vocabulary)."""
    fields = read_metadata(model)

    def value(key: str, default: object = None) -> object:
        found = fields.get(key)
        return default if found is None else found

    arch = str(value("general.architecture"))
    layers = int(value(f"{arch}.block_count"))
    heads = value(f"{arch}.attention.head_count")
    kv_heads = value(f"{arch}.attention.head_count_kv", heads)
    per_layer = tuple(kv_heads) if isinstance(kv_heads, list) else (int(kv_heads),) * layers
    first_heads = heads[0] if isinstance(heads, list) else heads
    head_dim = int(value(f"{arch}.embedding_length")) // int(first_heads)
    window = value(f"{arch}.attention.sliding_window")
    return KvShape(
        architecture=arch,
        layers=layers,
        kv_heads=tuple(int(h) for h in per_layer),
        key_length=int(value(f"{arch}.attention.key_length", head_dim)),
        value_length=int(value(f"{arch}.attention.value_length", head_dim)),
        sliding_window=None if window is None else int(window),
    )


@dataclass(frozen=True)
class KvPlan:
    layout: ServerLayout
    shape: KvShape
    type_k: str
    type_v: str

    @property
    def cells(self) -> int:
        return self.layout.total_ctx

    @property
    def kv_bytes(self) -> float:
        return self.cells * self.shape.cell_bytes(self.type_k, self.type_v)

    @property
    def alone_bytes(self) -> float:
        """The KV cache of llama-server alone with one slot of the same context."""
        return self.layout.slot_ctx * self.shape.cell_bytes(self.type_k, self.type_v)

    def server_flags(self, slot_save_dir: Path) -> list[str]:
        flags = verification_flags(self.layout, slot_save_dir)
        if self.type_k != "f16":
            flags += ["-ctk", self.type_k]
        if self.type_v != "f16":
            flags += ["-ctv", self.type_v]
        return flags


def plan_lines(plan: KvPlan, model: Path, slot_save_dir: Path) -> list[str]:
    shape, layout = plan.shape, plan.layout
    heads = sorted(set(shape.kv_heads))
    lines = [
        f"model {model}: {shape.architecture}, {shape.layers} layers, "
        f"{'/'.join(map(str, heads))} KV heads x {shape.key_length} (K) + "
        f"{shape.value_length} (V) per layer; KV cache K {plan.type_k}, V {plan.type_v}",
        f"slots: {layout.conversations} conversation(s) x (k+1 = {layout.group_size}) + "
        f"{layout.passthrough_slots} pass-through = {layout.slots}, "
        f"{layout.slot_ctx} tokens each",
        f"KV cache: {plan.kv_bytes / MIB:.2f} MiB for {plan.cells} cells "
        f"({plan.kv_bytes / GIB:.2f} GiB; llama-server alone with -c {layout.slot_ctx}: "
        f"{plan.alone_bytes / GIB:.2f} GiB; extra: {(plan.kv_bytes - plan.alone_bytes) / GIB:.2f}"
        " GiB)",
    ]
    if shape.sliding_window:
        lines.append(
            f"note: this model has sliding-window layers ({shape.sliding_window} tokens); "
            "llama.cpp keeps those smaller, so the real cache is smaller than shown"
        )
    flags = " ".join(plan.server_flags(slot_save_dir))
    lines.append(f"llama-server -m {model} {flags}")
    return lines
