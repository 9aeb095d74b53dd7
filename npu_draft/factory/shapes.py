"""Model shapes the factory can write.

`core` is the small function every factory model computes. The named big shapes
are the published Qwen3 sizes: a padded target of that shape costs what the real
model costs on the GPU while computing exactly the core function.
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
