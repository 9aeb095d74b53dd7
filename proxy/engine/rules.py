"""The greedy and the sampling rule: one object per generation, chosen once, with the
same interface. It drafts, verifies, accepts, and finds each committed token's piece.

Greedy keeps the target's argmax (`greedy_accept`); its drafts may be made early and
ahead, at the lengths the draft-length policy chooses. Sampling is the Leviathan/Chen
rule (`speculative_sample`) over the draft's q and the server's post-sampling p, with
its own random streams seeded by the request.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from npu_draft.protocol import SparseDist
from proxy.data.sampling import SamplingSpec
from proxy.data.verify import PlainRun, VerifyResult
from proxy.engine.acceptance import (
    Acceptance,
    RngChooser,
    Verdict,
    greedy_accept,
    normalized,
    speculative_sample,
)
from proxy.engine.draft_source import DraftOutcome, DraftSource
from proxy.engine.server_text import PieceCache, valid_utf8_prefix
from proxy.policies import Policies
from proxy.server.upstream import UpstreamClient

Dists = list[SparseDist | None] | None  # q per draft token in sampling mode
_RANDOM_SEED = 0xFFFFFFFF  # the server's "random seed"; the proxy's draws stay below it


class Rule(Protocol):
    sampled: bool  # the Leviathan/Chen rule (GenerationResult.sampled)

    async def draft(self, committed: list[int], k: int) -> DraftOutcome:
        """This round's draft of at most k tokens after `committed`."""
        ...

    def draft_ahead(self, n_drafted: int) -> bool | None:
        """While the server verifies the draft: draft ahead? (None: no choice made)"""
        ...

    async def verify(
        self, upstream: UpstreamClient, committed: list[int], draft: list[int]
    ) -> list[VerifyResult]:
        """One batch: the target's token after each prefix of the draft (sampling: the
        server's own draw with a seed of the rule's, and p)."""
        ...

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        """What the round commits: accepted drafts, then the target's (or the rule's) token."""
        ...

    def prepare_next(self, committed: list[int], k: int) -> None:
        """The next round's committed sequence is known: its draft of at most k may start."""
        ...

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        """(the bytes, is EOG) of committed `token` at the position of `result`."""
        ...

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        """The server decodes up to n tokens alone (sampling: the request's chain, a seed
        of the rule's)."""
        ...


class GreedyRule:
    """The target's argmax. Drafts have the draft-length policy's lengths, may start
    early (while the last round is committed) and grow ahead (while the server
    verifies) where the overlap policy says."""

    sampled = False

    def __init__(
        self, drafts: DraftSource, policies: Policies, pieces: PieceCache, early_draft: bool
    ) -> None:
        self.drafts = drafts
        self.policies = policies
        self.pieces = pieces
        self.early_draft = early_draft

    def _lengths(self, k: int, upcoming: int = 0) -> tuple[int, int]:
        """(most drafts, most drafted fresh) for a round allowed k, as the draft-length
        policy chooses for rounds that draft ahead as things stand or not (`upcoming`
        1: for the round after the one in progress)."""
        ahead = self.drafts.can_draft_ahead and self.policies.overlap.expects_ahead()
        most, fresh = self.policies.draft_length.decide(ahead, upcoming)
        k = min(k, most)
        return k, min(k, fresh)

    async def draft(self, committed: list[int], k: int) -> DraftOutcome:
        k, k_fresh = self._lengths(k)
        return await self.drafts.take(committed, k, k_fresh)

    def draft_ahead(self, n_drafted: int) -> bool | None:
        if not n_drafted:
            return None
        chosen = self.policies.overlap.decide(self.drafts.can_draft_ahead)
        if chosen:  # the bonus guess and the next round's drafts
            draft_length = self.policies.draft_length
            self.drafts.start_ahead(lambda: draft_length.decide(True, upcoming=1)[0] + 1)
        return chosen

    async def verify(
        self, upstream: UpstreamClient, committed: list[int], draft: list[int]
    ) -> list[VerifyResult]:
        return await upstream.verify(committed, draft)

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        return greedy_accept(draft, [r.token for r in results])

    def prepare_next(self, committed: list[int], k: int) -> None:
        """Draft the next round while this round's tokens are committed (wasted only
        where the generation stops)."""
        if self.early_draft:
            self.drafts.start_early(committed, *self._lengths(k, upcoming=1))

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        return await self.pieces.piece(result), result.is_eog

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        return await upstream.plain_run(committed, n, None, 0)


class SamplingRule:
    """Draws from the request's chain: the draft's q, the server's p, and the rule's
    own choices, each from a random stream of the request's seed."""

    sampled = True

    def __init__(
        self, drafts: DraftSource, spec: SamplingSpec, pieces: PieceCache, eog: frozenset[int]
    ) -> None:
        self.drafts = drafts
        self.spec = spec
        self.pieces = pieces
        self.eog = eog
        # Independent streams for the draft's draws, the rule's and the server's seeds:
        # a request seed replays all three, so the output reproduces.
        streams = np.random.SeedSequence(spec.seed).spawn(3)
        self._draft_rng, rule_rng, self._seed_rng = (np.random.default_rng(s) for s in streams)
        self._chooser = RngChooser(rule_rng)

    def _server_seed(self) -> int:
        return int(self._seed_rng.integers(0, _RANDOM_SEED))

    async def draft(self, committed: list[int], k: int) -> DraftOutcome:
        return await self.drafts.draft_sampled(committed, k, self.spec.chain, self._draft_rng)

    def draft_ahead(self, n_drafted: int) -> bool | None:
        return None  # a sampled line is not a greedy line to extend

    async def verify(
        self, upstream: UpstreamClient, committed: list[int], draft: list[int]
    ) -> list[VerifyResult]:
        return await upstream.verify(committed, draft, self.spec, self._server_seed())

    def accept(self, draft: list[int], dists: Dists, results: list[VerifyResult]) -> Acceptance:
        verdicts = [verdict_of(r) for r in results]
        return speculative_sample(draft, dists, verdicts, self._chooser)

    def prepare_next(self, committed: list[int], k: int) -> None:
        pass  # each round draws its draft afresh

    async def piece(self, result: VerifyResult, token: int) -> tuple[bytes, bool]:
        if token == result.token:
            return await self.pieces.piece(result), result.is_eog
        # our own draw: its bytes come with the server's candidates
        piece = _candidate_piece(result, token)
        if piece is None:
            piece = await self.pieces.token_piece(token)
        return piece, token in self.eog

    async def plain_run(self, upstream: UpstreamClient, committed: list[int], n: int) -> PlainRun:
        return await upstream.plain_run(committed, n, self.spec, self._server_seed())


async def rule_for(
    sampling: SamplingSpec | None,
    drafts: DraftSource,
    policies: Policies,
    pieces: PieceCache,
    early_draft: bool,
) -> Rule:
    """The generation's rule: greedy, or sampling with `sampling`'s chain and seed."""
    if sampling is None:
        return GreedyRule(drafts, policies, pieces, early_draft)
    return SamplingRule(drafts, sampling, pieces, await pieces.eog_tokens())


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
