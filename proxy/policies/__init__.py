"""The measured choices of the engine, each behind one interface: `decide` before a
round (how many drafts, whether to draft ahead, whether to let the server decode alone)
and `observe(record)` with what the round cost (`proxy.data.records.RoundRecord`).

The policies are shared by the requests of one proxy (the plain-run gate by the
requests of one kind); `Policies` bundles the ones a generation asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.policies.draft_length import DraftLengthPolicy, LengthRule
from proxy.policies.overlap import OverlapMode, OverlapPolicy
from proxy.policies.plain_runs import PlainRunGate, RunMode

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord


@dataclass
class Policies:
    draft_length: DraftLengthPolicy
    overlap: OverlapPolicy
    plain_runs: PlainRunGate | None = None  # None: always speculate

    @classmethod
    def fresh(
        cls,
        k_max: int,
        adaptive: bool = True,
        overlap: OverlapMode = "auto",
        plain_runs: PlainRunGate | None = None,
    ) -> Policies:
        """New policies that nothing was measured for yet (a proxy shares its own)."""
        return cls(DraftLengthPolicy(k_max, adaptive), OverlapPolicy(overlap), plain_runs)

    def plain_run_tokens(self) -> int:
        """Tokens the server should decode alone next; 0: a speculative round."""
        return 0 if self.plain_runs is None else self.plain_runs.decide()

    def prefers_plain(self) -> bool:
        """Plain runs are the measured choice right now."""
        return self.plain_runs is not None and self.plain_runs.prefers_plain()

    def measuring_first(self) -> bool:
        """The gate has measured nothing that could justify speculating yet."""
        return self.plain_runs is not None and self.plain_runs.measuring_first()

    def wants_drafter_speed(self) -> bool:
        """The gate waits for the drafter's speed (timed beside a plain run)."""
        return self.plain_runs is not None and self.plain_runs.wants_drafter_speed()

    def observe_drafter_speed(self, ms_per_token: float) -> None:
        """The drafter's own ms per drafted token, timed beside a plain run."""
        if self.plain_runs is not None:
            self.plain_runs.observe_drafter(ms_per_token)

    def observe(self, record: RoundRecord) -> None:
        """A round ended: the draft-length policy and the plain-run gate learn from it."""
        if self.plain_runs is not None:
            self.plain_runs.observe(record)
        self.draft_length.observe(record)

    def observe_next_draft(self, record: RoundRecord) -> None:
        """The round after `record` has its draft: what that waited (`next_drafted`,
        `next_draft_ms`) judges `record`'s choice to draft ahead (the overlap policy). It
        must judge before the round's own choice, so it cannot wait for the round's
        record."""
        self.overlap.observe(record)


__all__ = [
    "DraftLengthPolicy",
    "LengthRule",
    "OverlapMode",
    "OverlapPolicy",
    "PlainRunGate",
    "Policies",
    "RunMode",
]
