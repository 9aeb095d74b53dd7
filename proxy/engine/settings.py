"""What a generation is asked for (per request) and how the engine runs (per proxy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.data.sampling import SamplingSpec
from proxy.policies import LengthRule, OverlapMode, PadMode, RunMode, SharedPolicies

if TYPE_CHECKING:
    from proxy.config import ProxySettings


@dataclass
class GenerationParams:
    """One request's parameters the engine honours losslessly."""

    n_predict: int = -1  # after merging the server's default; -1 means unlimited
    stop: list[str] = field(default_factory=list)
    sampling: SamplingSpec | None = None  # None: greedy


@dataclass(frozen=True)
class EngineSettings:
    """The same for every request of one proxy."""

    k: int = 4  # the most drafts a round may verify
    adaptive: bool = True  # greedy: choose each round's length (proxy.policies.draft_length)
    draft_length: LengthRule = "formula"  # ... by this rule
    # greedy: draft while the server verifies (proxy.policies.overlap decides)
    overlap: OverlapMode = "auto"
    # greedy: start the next round's draft as soon as the verify result is known, behind
    # the proxy's own work on the round (else when the next round starts)
    early_draft: bool = True
    # greedy, drafting ahead: also the lines after the runner-ups at the likeliest misses
    runner_up_lines: bool = True
    # greedy: draft and send the next round's verification before this round's tokens
    # are streamed and recorded (that work then overlaps the server's)
    send_ahead: bool = True
    # greedy: pad each round of the same length as the last to one batch shape, in a slot
    # of its own, so the server reuses its compute graph (proxy.engine.round_shape);
    # measured (proxy.policies.padding): off unless a proxy's settings say so
    pad_rounds: PadMode = "off"
    check_decodes: bool = False  # count the server's decodes per round; warn when not one
    strict_decodes: bool = False  # ... and fail the generation instead (implies checking)
    # speculate or let the server decode alone, measured (proxy.policies.plain_runs); off
    # unless a proxy's settings say so: the gate learns across the requests it serves
    plain_runs: RunMode = "off"

    def policies(self) -> SharedPolicies:
        """Fresh policies for these settings: a proxy builds its shared ones once, a
        generation given none builds its own."""
        return SharedPolicies.build(
            self.k,
            self.adaptive,
            self.draft_length,
            self.overlap,
            self.plain_runs,
            self.pad_rounds,
        )

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> EngineSettings:
        """The engine's part of a proxy's settings."""
        return cls(
            k=settings.k,
            adaptive=settings.adaptive_k,
            draft_length=settings.draft_length,
            overlap=settings.overlap,
            early_draft=settings.early_draft,
            runner_up_lines=settings.runner_up_lines,
            send_ahead=settings.send_ahead,
            pad_rounds=settings.pad_rounds,
            check_decodes=settings.check_decodes,
            strict_decodes=settings.strict_decodes,
            plain_runs=settings.plain_runs,
        )
