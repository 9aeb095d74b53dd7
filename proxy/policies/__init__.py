"""The measured choices of the engine, each behind one interface: `decide` before a
round (how many drafts, whether to draft ahead, whether to let the server decode alone)
and `observe(record)` with what the round cost (`proxy.data.records.RoundRecord`).

The policies are shared by the requests of one proxy (the plain-run gate by the
requests of one kind): `SharedPolicies.build` makes them from the settings, and
`SharedPolicies.for_request` bundles the ones a generation asks (`Policies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from proxy.policies.draft_length import DraftLengthPolicy, LengthRule
from proxy.policies.overlap import OverlapMode, OverlapPolicy
from proxy.policies.padding import PaddingPolicy, PadMode
from proxy.policies.plain_runs import PlainRunGate, RunMode

if TYPE_CHECKING:
    from proxy.data.records import RoundRecord
    from proxy.data.sampling import SamplingSpec


class SlotGrant(Protocol):
    """A generation's share of the server's slots (`proxy.slot_share.StreamLease`)."""

    def grant(self) -> int:
        """Drafts the next round may verify; 0: yield to other streams."""
        ...

    def hold(self, extra: int) -> None: ...

    def alone(self) -> bool: ...


@dataclass
class Policies:
    """The policies one generation asks (`SharedPolicies.for_request`)."""

    draft_length: DraftLengthPolicy
    overlap: OverlapPolicy
    plain_runs: PlainRunGate | None = None  # None: always speculate
    slots: SlotGrant | None = None  # None: the generation has the server to itself
    padding: PaddingPolicy = field(default_factory=lambda: PaddingPolicy("off"))

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

    def alone(self) -> bool:
        """The generation has the server's slots to itself (no other stream)."""
        return self.slots is None or self.slots.alone()

    def spare_slots(self, n_prompts: int) -> bool:
        """Whether a batch of `n_prompts` prompts finds an idle slot for each: the
        generation alone on a server of at least that many slots (a prompt without one
        would wait for the batch to end; no slot share, as in tests: yes)."""
        if self.slots is None:
            return True
        return self.slots.alone() and self.slots.share.total_slots >= n_prompts

    def prefers_plain(self) -> bool:
        """Plain runs are the measured choice right now."""
        return self.plain_runs is not None and self.plain_runs.prefers_plain()

    def measuring_first(self) -> bool:
        """The gate has measured nothing that could justify speculating yet."""
        return self.plain_runs is not None and self.plain_runs.measuring_first()

    def wants_drafter_speed(self) -> bool:
        """The gate waits for the drafter's speed (timed beside a plain run)."""
        return self.plain_runs is not None and self.plain_runs.wants_drafter_speed()

    def wants_shadow_draft(self) -> bool:
        """The next plain run should have a draft beside it, checked against the run's
        tokens (`PlainRunGate.wants_shadow`; not while other streams share the slots:
        the gate compares rates alone)."""
        return (
            self.plain_runs is not None
            and self.plain_runs.wants_shadow()
            and (self.slots is None or self.slots.alone())
        )

    def shadow_window(self) -> int:
        """Which due re-measurement a draft started now is checked for."""
        return self.plain_runs.shadow_window if self.plain_runs is not None else 0

    def observe_shadow_draft(self, n_accepted: int, rejected: bool, window: int) -> None:
        """A draft beside a plain run, started in `window`: its first `n_accepted`
        tokens were the run's."""
        if self.plain_runs is not None:
            self.plain_runs.observe_shadow(n_accepted, rejected, window)

    def observe_drafter_speed(self, ms_per_token: float) -> None:
        """The drafter's own ms per drafted token, timed beside a plain run."""
        if self.plain_runs is not None:
            self.plain_runs.observe_drafter(ms_per_token)

    def observe(self, record: RoundRecord) -> None:
        """A round ended: the draft-length policy and the plain-run gate learn from it
        (the gate only from rounds without other streams: it compares rates alone; and
        not from rounds sent at a length chosen to measure it, such as the first sweep's
        k = 2 rounds that cross Strix Halo's 8-token edge, nor from rounds that try the
        other padding of a length). The gate also hears what a free drafter could reach
        on the verify times measured so far."""
        # a round that sent no draft measured no length: the policy does not count it,
        # so its round index would stay "exploring" for as long as the drafter yields
        # nothing, and the gate would never see what such rounds cost (H200, 4k: a
        # request off the oracle's path ran ~100 one-prompt rounds at ~3 plain steps
        # each and the gate chose nothing)
        exploring = self.draft_length.exploring_now() and record.n_drafted > 0
        # a round padded otherwise than its length runs, to compare the two: what it
        # cost is no length's cost and no speculation speed (like exploring, for the gate)
        trial = self.padding.trial(record)
        self.draft_length.observe(record, costs=not trial)
        gate = self.plain_runs
        if gate is not None and (self.slots is None or self.slots.alone()):
            # the ceiling only matters while speculation is the choice
            ceiling = None if gate.plain_chosen else self.draft_length.ceiling_ms_per_token()
            gate.observe(record, exploring=exploring or trial, ceiling_ms=ceiling)
        self.padding.observe(record)

    def observe_generation(self, n_tokens: int) -> None:
        """A generation ended after writing `n_tokens` (the gate spreads a cold
        request's cost over a request's length)."""
        if self.plain_runs is not None:
            self.plain_runs.observe_request(n_tokens)

    def observe_next_draft(self, record: RoundRecord) -> None:
        """The round after `record` has its draft: what that waited (`next_drafted`,
        `next_draft_ms`) judges `record`'s choice to draft ahead (the overlap policy). It
        must judge before the round's own choice, so it cannot wait for the round's
        record."""
        self.overlap.observe(record)


@dataclass
class SharedPolicies:
    """The policies the requests of one proxy share, built from its settings
    (`build`, the only constructor, in production and in tests)."""

    draft_length: DraftLengthPolicy
    overlap: OverlapPolicy
    # one plain-run gate per kind of request: a sampling round costs more (the server
    # sends its distribution back), so the two are measured apart
    plain_runs: PlainRunGate
    sampled_plain_runs: PlainRunGate
    padding: PaddingPolicy

    @classmethod
    def build(
        cls,
        k_max: int,
        adaptive: bool = True,
        draft_length: LengthRule = "formula",
        overlap: OverlapMode = "auto",
        plain_runs: RunMode = "off",
        pad_rounds: PadMode = "off",
    ) -> SharedPolicies:
        """Policies that nothing was measured for yet. Only the greedy gate checks
        drafts beside plain runs: a sampled run's tokens are draws, not what a round
        would have accepted."""
        lengths = DraftLengthPolicy(k_max, adaptive, draft_length)
        return cls(
            lengths,
            OverlapPolicy(overlap),
            PlainRunGate(plain_runs, model=lengths),
            PlainRunGate(plain_runs, name="unseeded sampling"),
            PaddingPolicy(pad_rounds),
        )

    def gate_for(self, sampling: SamplingSpec | None) -> PlainRunGate | None:
        """The plain-run gate for a request. A seeded sampling request always
        speculates: its draws then depend on its seed alone, not on what the proxy
        measured before."""
        if sampling is None:
            return self.plain_runs
        return None if sampling.seed is not None else self.sampled_plain_runs

    def for_request(
        self, sampling: SamplingSpec | None, slots: SlotGrant | None = None
    ) -> Policies:
        """What a generation of this kind (greedy, or `sampling`) asks; `slots`: its
        share of the server's slots (None: the server to itself)."""
        return Policies(
            self.draft_length, self.overlap, self.gate_for(sampling), slots, self.padding
        )


__all__ = [
    "DraftLengthPolicy",
    "LengthRule",
    "OverlapMode",
    "OverlapPolicy",
    "PadMode",
    "PaddingPolicy",
    "PlainRunGate",
    "Policies",
    "RunMode",
    "SharedPolicies",
    "SlotGrant",
]
