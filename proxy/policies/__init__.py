"""The measured choices of the engine, each behind one interface: `decide` before a
round (how many drafts, whether to draft ahead, whether to let the server decode alone)
and `observe(record)` with what the round cost (`proxy.engine.records.RoundRecord`).

The policies are shared by the requests of one proxy (the plain-run gate by the
requests of one kind); `Policies` bundles the ones a generation asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from proxy.policies.draft_length import DraftLengthPolicy, LengthRule
from proxy.policies.overlap import OverlapMode, OverlapPolicy
from proxy.policies.plain_runs import PlainRunGate, RunMode

if TYPE_CHECKING:
    from proxy.engine.records import RoundRecord


class SlotGrant(Protocol):
    """A generation's share of the server's slots (`proxy.slot_share.StreamLease`)."""

    def grant(self) -> int:
        """Drafts the next round may verify; 0: yield to other streams."""
        ...

    def hold(self, extra: int) -> None: ...

    def alone(self) -> bool: ...


@dataclass
class Policies:
    draft_length: DraftLengthPolicy
    overlap: OverlapPolicy
    plain_runs: PlainRunGate | None = None  # None: always speculate
    slots: SlotGrant | None = None  # None: the generation has the server to itself

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
        """Tokens the server should decode alone next; 0: a speculative round. Where
        other streams need the slots (`slots.grant()` 0), a plain run: the generation
        yields, and speculates again once they are gone."""
        if self.plain_runs is None:
            return 0
        if self.slots is not None and self.slots.grant() == 0:
            return self.plain_runs.run_tokens
        n = self.plain_runs.decide()
        if n and self.slots is not None:
            self.slots.hold(0)  # one slot for the run
        return n

    def k_cap(self, k_max: int) -> int:
        """The most drafts the next round may verify, given the other streams."""
        return k_max if self.slots is None else min(k_max, self.slots.grant())

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
        """A round ended: the draft-length policy and the plain-run gate learn from it
        (the gate only from rounds without other streams: it compares rates alone)."""
        if self.plain_runs is not None and (self.slots is None or self.slots.alone()):
            self.plain_runs.observe(record)
        self.draft_length.observe(record)

    def observe_next_draft(self, record: RoundRecord, n_drafted: int, draft_ms: float) -> None:
        """The round after `record` has its draft: what that waited judges `record`'s
        choice to draft ahead (the overlap policy). It must judge before the round's own
        choice, so it cannot wait for the round's record."""
        record.next_drafted, record.next_draft_ms = n_drafted, draft_ms
        self.overlap.observe(record)


__all__ = [
    "DraftLengthPolicy",
    "LengthRule",
    "OverlapMode",
    "OverlapPolicy",
    "PlainRunGate",
    "Policies",
    "RunMode",
    "SlotGrant",
]
