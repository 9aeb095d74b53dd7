"""A plain numpy Qwen3 decoder: the exact reference for tests and the model factory.

It reads the Hugging Face folders the factory writes (config.json +
model.safetensors), keeps a KV cache that rolls back by length, and implements the
DraftModel protocol, so it can stand in for an ONNX drafter wherever exactness
matters more than speed (backend name "reference", always on the CPU).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DrafterInfo,
    SamplingParams,
    SyncStats,
    common_prefix_length,
)
from npu_draft.sampling import greedy_choice


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_json(cls, path: Path) -> Qwen3Config:
        raw = json.loads(Path(path).read_text())
        rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get(
            "rope_theta", 1_000_000.0
        )
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)).astype(np.float32) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return shifted / np.sum(shifted, axis=-1, keepdims=True)


class Qwen3Numpy:
    """Weights plus a forward pass over a shared-prefix KV cache."""

    def __init__(self, config: Qwen3Config, weights: dict[str, np.ndarray]) -> None:
        self.config = config
        self.w = {name: np.asarray(value, dtype=np.float32) for name, value in weights.items()}
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        half = config.head_dim // 2
        self._inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))

    @classmethod
    def from_hf(cls, folder: str | Path) -> Qwen3Numpy:
        folder = Path(folder)
        return cls(
            Qwen3Config.from_json(folder / "config.json"), load_file(folder / "model.safetensors")
        )

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        shape = (c.num_hidden_layers, c.num_key_value_heads, max_len, c.head_dim)
        return KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32), 0)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # x: [heads, n, head_dim]; rotate-half (NeoX) layout as in Hugging Face Qwen3.
        angles = positions[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos = np.cos(np.concatenate([angles, angles], axis=-1)).astype(np.float32)
        sin = np.sin(np.concatenate([angles, angles], axis=-1)).astype(np.float32)
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def forward(self, tokens: Sequence[int], cache: KVCache) -> np.ndarray:
        """Run `tokens` after the cache's current length; return logits [n, vocab]."""
        c, w = self.config, self.w
        n = len(tokens)
        start = cache.length
        if start + n > cache.keys.shape[2]:
            raise ValueError(
                f"sequence of {start + n} tokens exceeds cache of {cache.keys.shape[2]}"
            )
        positions = np.arange(start, start + n)
        x = w["model.embed_tokens.weight"][np.asarray(tokens, dtype=np.int64)]
        group = c.num_attention_heads // c.num_key_value_heads
        # causal mask over [n, start + n]
        mask = np.triu(np.full((n, start + n), -np.inf, np.float32), k=start + 1)
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(
                n, c.num_attention_heads, c.head_dim
            )
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(
                n, c.num_key_value_heads, c.head_dim
            )
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(
                n, c.num_key_value_heads, c.head_dim
            )
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps).transpose(1, 0, 2)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps).transpose(1, 0, 2)
            q, k = self._rope(q, positions), self._rope(k, positions)
            cache.keys[layer, :, start : start + n] = k
            cache.values[layer, :, start : start + n] = v.transpose(1, 0, 2)
            keys = np.repeat(cache.keys[layer, :, : start + n], group, axis=0)
            values = np.repeat(cache.values[layer, :, : start + n], group, axis=0)
            scores = q @ keys.transpose(0, 2, 1) / np.sqrt(c.head_dim) + mask
            attn = (_softmax(scores) @ values).transpose(1, 0, 2).reshape(n, -1)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (_silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        cache.length = start + n
        x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
        return x @ w["lm_head.weight"].T


@dataclass
class KVCache:
    keys: np.ndarray  # [layers, kv_heads, max_len, head_dim]
    values: np.ndarray
    length: int


class ReferenceDraftSession:
    """DraftSession over the numpy model: rollback is `cache.length = n`."""

    def __init__(self, model: Qwen3Numpy, max_len: int) -> None:
        self._model = model
        self._cache = model.new_cache(max_len)
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None  # logits after self._tokens

    @property
    def tokens(self) -> Sequence[int]:
        return tuple(self._tokens)

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        tokens = list(tokens)
        if not tokens:
            raise ValueError("cannot sync to an empty sequence")
        keep = common_prefix_length(self._tokens, tokens)
        if keep == len(tokens) == len(self._tokens) and self._logits is not None:
            return SyncStats(reused=keep, appended=0)
        # The last kept token is re-run when nothing new follows it, to get its logits.
        keep = min(keep, len(tokens) - 1)
        self._cache.length = keep
        self._logits = self._model.forward(tokens[keep:], self._cache)[-1]
        self._tokens = tokens
        return SyncStats(reused=keep, appended=len(tokens) - keep)

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        if not sampling.greedy:
            raise NotImplementedError("the reference drafter drafts greedily only")
        draft = Draft()
        for _ in range(k):
            if cancel is not None and cancel.cancelled:
                break
            if len(self._tokens) >= self._cache.keys.shape[2]:
                break
            logits = self.next_logits()
            token, prob = greedy_choice(logits)
            draft.tokens.append(token)
            draft.probs.append(prob)
            self._logits = self._model.forward([token], self._cache)[-1]
            self._tokens.append(token)
        return draft

    def next_logits(self) -> np.ndarray:
        if self._logits is None:
            raise RuntimeError("sync() the session before asking for logits")
        return self._logits

    def close(self) -> None:
        self._tokens = []
        self._logits = None


class ReferenceDraftModel:
    """DraftModel for a Hugging Face Qwen3 folder, computed exactly in numpy."""

    def __init__(self, folder: str | Path, max_context: int = 4096) -> None:
        folder = Path(folder)
        self.model = Qwen3Numpy.from_hf(folder)
        generation = _read_json(folder / "generation_config.json")
        eos = generation.get("eos_token_id", [])
        self.info = DrafterInfo(
            name=folder.name,
            backend="reference",
            provider="cpu",
            vocab_size=self.model.config.vocab_size,
            max_context=max_context,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            bos_token_id=generation.get("bos_token_id"),
        )

    @classmethod
    def from_hf(cls, folder: str | Path, max_context: int = 4096) -> ReferenceDraftModel:
        return cls(folder, max_context)

    def open_session(self) -> ReferenceDraftSession:
        return ReferenceDraftSession(self.model, self.info.max_context)

    def close(self) -> None:
        pass


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
