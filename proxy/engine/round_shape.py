"""One batch shape for a generation's verify rounds (`--pad-rounds`).

llama.cpp reuses its compute graph only for a batch of the same shape as the last one
(tokens, outputs, sequences, KV span), and ggml's CUDA backend replays a captured CUDA
graph only from the third batch of one shape in a row; any other batch launches every
kernel anew. A steady round of k drafts ingests (k+1)(k+2)/2 + j(j+1)/2 tokens after
j of the last round's k drafts were accepted (`proxy.bench.verify_cost`,
`expected_round_tokens`), so consecutive rounds almost never share a shape, while
llama.cpp's own decoding (one token a step) always does. Upstream this is
ggml-org/llama.cpp#27009 (shape-stable padded batches for multi-slot decode) and #28652
(speculative decoding keeps resetting the CUDA graph warm-up).

Here the proxy pads instead: every round of k drafts after a round of k drafts carries
one more prompt, in a slot of its own, that ingests exactly the tokens the round lacks
to (k+1)^2 + 1, so a run of rounds of one length is a run of batches of one shape.
The pad prompt is a fixed base and a tail that alternates between two tokens, so the
slot keeps the base and ingests only the tail (the server reuses the longest common
prefix). Only speed depends on it: a round whose ingestion was predicted wrong is a
batch of another shape, nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PAD_BASE = 16  # tokens the pad slot keeps between rounds


def round_tokens(k: int, accepted: int) -> int:
    """Tokens a round of k drafts ingests after a round of k drafts of which `accepted`
    were accepted: each prompt its correction and its drafts, and each slot that held
    fewer than `accepted` of the last drafts what it lacks of them."""
    return (k + 1) * (k + 2) // 2 + accepted * (accepted + 1) // 2


def padded_tokens(k: int) -> int:
    """The token count every padded round of k drafts has: the most a round can ingest
    (all k of the last drafts accepted), plus the pad prompt's least, one token."""
    return round_tokens(k, k) + 1


def filler_tokens(prompt: Sequence[int]) -> tuple[int, int, int]:
    """Three distinct small token ids (valid in any vocabulary) for the pad prompt, none
    the prompt's first: the base then shares no prefix with the generation's slots."""
    first = prompt[0] if prompt else -1
    ids = [t for t in (1, 2, 3, 4) if t != first]
    return ids[0], ids[1], ids[2]


@dataclass
class RoundShape:
    """The pad prompt of each round of one generation."""

    filler: tuple[int, int, int]
    # the slot the pad prompt used last (-1: none yet): no copy may go there
    slot: int = -1
    _flip: bool = field(default=False, repr=False)

    def pad(self, k: int, accepted: int) -> list[int]:
        """The pad prompt of a round of k drafts after a round of k drafts of which
        `accepted` were accepted: the base and a tail of the tokens the round lacks to
        `padded_tokens(k)` (a new tail token each time, so only the tail is ingested)."""
        tail = padded_tokens(k) - round_tokens(k, accepted)
        self._flip = not self._flip
        token = self.filler[1] if self._flip else self.filler[2]
        return [self.filler[0]] * PAD_BASE + [token] * tail

    @staticmethod
    def tail(pad: Sequence[int]) -> int:
        """The tokens `pad` makes its slot ingest once the slot holds the base."""
        return max(len(pad) - PAD_BASE, 0)
