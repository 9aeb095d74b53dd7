"""Which tokenizer a drafter expects, and the refusal of a target that uses another.

Draft and target exchange token ids, never text, so a drafter built for another
vocabulary does not fail: it proposes plausible-looking ids that are never accepted.
A drafter folder therefore records its tokenizer's facts in `npu_draft.json`:
vocabulary size (the logits width), BOS/EOS ids, and the ids of a fixed probe text
that exercises byte-level BPE, digits, CJK, emoji and the chat special tokens. The
proxy gathers the same facts from the target (GGUF metadata, or llama-server's
`/props` and `/tokenize` of PROBE_TEXT with `parse_special`) and calls
`check_tokenizer_match`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST_NAME = "npu_draft.json"

PROBE_TEXT = (
    "<|im_start|>user\nTokenizer probe: naïve café, 12345 + 0.678 = x; "
    "def f(a, b):\n    return a**b  # 注释 日本語 🙂\n<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n<|endoftext|>"
)


class TokenizerMismatch(RuntimeError):
    """Draft and target models do not share a tokenizer."""


@dataclass(frozen=True)
class TokenizerFacts:
    name: str  # the model these facts describe, for messages
    vocab_size: int | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    probe_ids: tuple[int, ...] | None = None  # ids of PROBE_TEXT, special tokens parsed

    @property
    def fingerprint(self) -> str:
        """Short digest of the facts that must agree (not of the name)."""
        payload = json.dumps(
            [self.vocab_size, self.bos_token_id, sorted(self.eos_token_ids), self.probe_ids]
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "probe_text": PROBE_TEXT,
            "probe_ids": None if self.probe_ids is None else list(self.probe_ids),
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: dict, name: str | None = None) -> TokenizerFacts:
        probe_ids = data.get("probe_ids")
        if data.get("probe_text", PROBE_TEXT) != PROBE_TEXT:
            probe_ids = None  # recorded against another probe: not comparable
        return cls(
            name=name or data.get("name", "?"),
            vocab_size=data.get("vocab_size"),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=tuple(data.get("eos_token_ids") or ()),
            probe_ids=None if probe_ids is None else tuple(probe_ids),
        )


def check_tokenizer_match(drafter: TokenizerFacts, target: TokenizerFacts) -> None:
    """Raise TokenizerMismatch naming both models unless their tokenizers agree.

    Facts unknown on either side (None) are skipped; every target EOS id must be one
    the drafter knows as EOS (Qwen checkpoints list both <|im_end|> and
    <|endoftext|>, a GGUF often only one of them).
    """
    problems: list[str] = []
    if None not in (drafter.vocab_size, target.vocab_size) and (
        drafter.vocab_size != target.vocab_size
    ):
        problems.append(f"vocabulary size {drafter.vocab_size} vs {target.vocab_size}")
    if None not in (drafter.bos_token_id, target.bos_token_id) and (
        drafter.bos_token_id != target.bos_token_id
    ):
        problems.append(f"BOS id {drafter.bos_token_id} vs {target.bos_token_id}")
    if drafter.eos_token_ids and target.eos_token_ids:
        missing = sorted(set(target.eos_token_ids) - set(drafter.eos_token_ids))
        if missing:
            problems.append(
                f"EOS ids {sorted(drafter.eos_token_ids)} vs {sorted(target.eos_token_ids)}"
            )
    if None not in (drafter.probe_ids, target.probe_ids) and (
        drafter.probe_ids != target.probe_ids
    ):
        at = _first_difference(drafter.probe_ids, target.probe_ids)
        problems.append(
            f"probe text tokenizes differently from token {at} "
            f"({len(drafter.probe_ids)} vs {len(target.probe_ids)} tokens)"
        )
    if problems:
        raise TokenizerMismatch(
            f"draft model {drafter.name!r} and target model {target.name!r} do not share a "
            f"tokenizer: {'; '.join(problems)}. Use a drafter exported from a checkpoint "
            f"of the target's family (npu-spec export-drafter)."
        )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable):
        return [int(v) for v in value]
    return []


def facts_from_hf_folder(folder: str | Path, name: str | None = None) -> TokenizerFacts:
    """Facts of a Hugging Face checkpoint: config.json (+ generation_config.json) and
    tokenizer.json, read with the `tokenizers` library only."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    tok_config = _read_json(folder / "tokenizer_config.json")
    eos: list[int] = []
    for source in (config.get("eos_token_id"), generation.get("eos_token_id")):
        eos += [i for i in _ids(source) if i not in eos]
    probe_ids = None
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        probe_ids = tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids)
        eos_name = tok_config.get("eos_token")
        eos_name = eos_name.get("content") if isinstance(eos_name, dict) else eos_name
        eos_id = tokenizer.token_to_id(eos_name) if isinstance(eos_name, str) else None
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
    bos = config.get("bos_token_id", generation.get("bos_token_id"))
    return TokenizerFacts(
        name=name or folder.name,
        vocab_size=config.get("vocab_size"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        probe_ids=probe_ids,
    )


def facts_from_gguf(path: str | Path, name: str | None = None) -> TokenizerFacts:
    """Facts of a GGUF target from its metadata (no probe: that needs the server)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def scalar(key: str) -> int | None:
        field_ = reader.fields.get(key)
        return None if field_ is None else int(field_.parts[field_.data[0]][0])

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    eos = [scalar("tokenizer.ggml.eos_token_id"), scalar("tokenizer.ggml.eot_token_id")]
    return TokenizerFacts(
        name=name or Path(path).name,
        vocab_size=None if tokens is None else len(tokens.data),
        bos_token_id=scalar("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
    )


def target_facts(
    name: str,
    vocab_size: int | None,
    bos_token_id: int | None,
    eos_token_ids: Iterable[int],
    probe_ids: Sequence[int] | None = None,
) -> TokenizerFacts:
    """Facts the proxy assembled from a running llama-server (`/props`, `/tokenize`)."""
    return TokenizerFacts(
        name=name,
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_ids=tuple(eos_token_ids),
        probe_ids=None if probe_ids is None else tuple(probe_ids),
    )


@dataclass
class DrafterManifest:
    """`npu_draft.json` in a drafter folder: what it was built from and what it expects."""

    tokenizer: TokenizerFacts
    format: str = "genai"
    precision: str = "fp32"
    source: str = ""
    decoder: dict = field(default_factory=dict)  # num_layers, num_kv_heads, head_dim, ...

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        data = {
            "format": self.format,
            "precision": self.precision,
            "source": self.source,
            "decoder": self.decoder,
            "tokenizer": self.tokenizer.to_json(),
        }
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def read(cls, folder: str | Path) -> DrafterManifest | None:
        path = Path(folder) / MANIFEST_NAME
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        tokenizer = data.get("tokenizer", {})
        return cls(
            tokenizer=TokenizerFacts.from_json(
                tokenizer, name=tokenizer.get("name") or Path(folder).name
            ),
            format=data.get("format", "genai"),
            precision=data.get("precision", "fp32"),
            source=data.get("source", ""),
            decoder=data.get("decoder", {}),
        )


def drafter_facts(folder: str | Path) -> TokenizerFacts | None:
    """The tokenizer a drafter folder expects: its manifest, else its own tokenizer
    files (a folder built by another tool)."""
    manifest = DrafterManifest.read(folder)
    if manifest is not None:
        return manifest.tokenizer
    folder = Path(folder)
    if (folder / "config.json").exists():
        return facts_from_hf_folder(folder)
    return None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
