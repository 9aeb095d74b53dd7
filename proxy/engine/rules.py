"""The greedy and the sampling rule: one object per generation, chosen once, with the
same interface: it verifies (a round's batch, or a plain run) and accepts (what the
round commits, and each committed token's piece).

Greedy keeps the target's argmax (`greedy_accept`). Sampling is the Leviathan/Chen
rule (`speculative_sample`) over the draft's q and the server's post-sampling p, with
its own random streams seeded by the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from proxy.data.sampling import SamplingSpec
from proxy.data.verify import PlainRun, VerifyResult
from proxy.engine.acceptance import (
    Acceptance,
    Dists,
    RngChooser,
    Verdict,
    greedy_accept,
    normalized,
    speculative_sample,
)
from proxy.engine.server_text import PieceCache, valid_utf8_prefix
from proxy.server.upstream import UpstreamClient

_RANDOM_SEED = 0xFFFFFFFF  # the server's "random seed"; the proxy's draws stay below it


class Rule(Protocol):
    """Verify and accept: how a round's draft is checked against the server and what
    the round commits. Where the draft comes from is the proposer's
    (`proxy.engine.proposer`)."""

    sampled: bool  # the Leviathan/Chen rule (GenerationResult.sampled)

    async def verify(
        self,
        upstream: UpstreamClient,
        committed: list[int],
        draft: list[int],
        pad: Sequence[int] = (),
    ) -> list[VerifyResult]:
        """One batch: the target's token after each prefix of the draft (sampling: the
        server's own draw with a seed of the rule's, and p); `pad`'s result last."""
        ...

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        """The server decodes up to n tokens alone (sampling: the request's chain, a seed
        of the rule's)."""
        ...

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        """What the round commits: accepted drafts, then the target's (or the rule's) token."""
        ...

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        """(the bytes, is EOG) of committed `token` at the position of `result`."""
        ...


class GreedyRule:
    """The target's argmax."""

    sampled = False

    def __init__(self, pieces: PieceCache) -> None:
        self.pieces = pieces

    async def verify(
        self,
        upstream: UpstreamClient,
        committed: list[int],
        draft: list[int],
        pad: Sequence[int] = (),
    ) -> list[VerifyResult]:
        return await upstream.verify(committed, draft, pad=pad)

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        return await upstream.plain_run(committed, n, None, 0)

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        return greedy_accept(draft, [r.token for r in results])

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        return await self.pieces.piece(result), result.is_eog


class SamplingRule:
    """Draws from the request's chain: the draft's q, the server's p, and the rule's
    own choices, each from a random stream of the request's seed (`draft_rng` is the
    draft's, for the proposer)."""

    sampled = True

    def __init__(self, spec: SamplingSpec, pieces: PieceCache, eog: frozenset[int]) -> None:
        self.spec = spec
        self.pieces = pieces
        self.eog = eog
        # Independent streams for the draft's draws, the rule's and the server's seeds:
        # a request seed replays all three, so the output reproduces.
        streams = np.random.SeedSequence(spec.seed).spawn(3)
        self.draft_rng, rule_rng, self._seed_rng = (np.random.default_rng(s) for s in streams)
        self._chooser = RngChooser(rule_rng)

    def _server_seed(self) -> int:
        return int(self._seed_rng.integers(0, _RANDOM_SEED))

    async def verify(
        self,
        upstream: UpstreamClient,
        committed: list[int],
        draft: list[int],
        pad: Sequence[int] = (),
    ) -> list[VerifyResult]:
        return await upstream.verify(committed, draft, self.spec, self._server_seed(), pad)

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        return await upstream.plain_run(committed, n, self.spec, self._server_seed())

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        verdicts = [verdict_of(r) for r in results]
        return speculative_sample(draft, dists, verdicts, self._chooser)

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        if token == result.token:
            return await self.pieces.piece(result), result.is_eog
        # our own draw: its bytes come with the server's candidates
        piece = _candidate_piece(result, token)
        if piece is None:
            piece = await self.pieces.token_piece(token)
        return piece, token in self.eog


async def rule_for(sampling: SamplingSpec | None, pieces: PieceCache) -> GreedyRule | SamplingRule:
    """The generation's rule: greedy, or sampling with `sampling`'s chain and seed."""
    if sampling is None:
        return GreedyRule(pieces)
    return SamplingRule(sampling, pieces, await pieces.eog_tokens())


def verdict_of(result: VerifyResult) -> Verdict:
    """The rule's view of one sampling verify result."""
    if not result.candidates:
        return Verdict(result.token, None)
    ids = np.array([c[0] for c in result.candidates], dtype=np.int64)
    probs = np.array([c[2] for c in result.candidates], dtype=np.float64)
    dist = normalized(ids, probs)  # float32 values in the JSON: renormalise
    # the candidates whose piece alone ends inside a UTF-8 character: had the server
    # drawn one of them it would have sent no probabilities (see speculative_sample)
    partial = frozenset(c[0] for c in result.candidates if valid_utf8_prefix(c[1]) < len(c[1]))
    return Verdict(result.token, dist, partial)


def _candidate_piece(result: VerifyResult, token: int) -> bytes | None:
    for candidate, piece, _prob in result.candidates or ():
        if candidate == token:
            return piece
    return None
