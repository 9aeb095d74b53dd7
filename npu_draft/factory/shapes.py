"""Model shapes the factory can write.

`core` is the small function every factory model computes. The named big shapes
are the published Qwen3 sizes: a padded target (or draft) of that shape costs what
the real model costs while computing exactly the core (or core draft) function.

Qwen3-0.6B and -1.7B tie their output head to the token embeddings; a padded draft
cannot (the core's embedding and head differ, and both would have to sit in the
same columns), so it keeps a separate head of the same shape. Per token that costs
the same (the head is one [vocab, hidden] matrix-vector product either way, and the
embedding lookup reads one row); only the file is larger by one embedding table.
"""

from __future__ import annotations

from dataclasses import dataclass

QWEN_VOCAB_SIZE = 151_936
HEAD_DIM = 128


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = HEAD_DIM
    vocab: int = QWEN_VOCAB_SIZE

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


CORE = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=768)

TARGET_SHAPES: dict[str, ModelShape] = {
    "small": CORE,
    # A padded shape small enough for CI: proves the padding computes the core function.
    "padded-test": ModelShape(hidden=512, layers=4, heads=8, kv_heads=2, ffn=1536),
    "qwen3-8b": ModelShape(hidden=4096, layers=36, heads=32, kv_heads=8, ffn=12288),
    "qwen3-14b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=8, ffn=17408),
    "qwen3-32b": ModelShape(hidden=5120, layers=64, heads=64, kv_heads=8, ffn=25600),
}

DRAFT_SHAPES: dict[str, ModelShape] = {
    "core": CORE,
    # A padded draft small enough for CI, grouped like the Qwen3 drafts (2 query heads per KV).
    "padded-test": ModelShape(hidden=512, layers=3, heads=8, kv_heads=4, ffn=1536),
    "qwen3-0.6b": ModelShape(hidden=1024, layers=28, heads=16, kv_heads=8, ffn=3072),
    "qwen3-1.7b": ModelShape(hidden=2048, layers=28, heads=16, kv_heads=8, ffn=6144),
}


def default_draft_shape(target_shape: str) -> str:
    """What the named big targets draft with in practice; CI's models keep the core."""
    return "qwen3-0.6b" if target_shape.startswith("qwen3-") else "core"
