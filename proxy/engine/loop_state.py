"""What the generation loop keeps between rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.data.records import RoundRecord
from proxy.engine.server_text import ServerTextState


@dataclass
class LoopState:
    text: ServerTextState  # the server's text bookkeeping, mirrored token by token
    started: float  # perf_counter s
    last_back: float  # when the server last answered this generation (its start at first)
    rounds: list[RoundRecord] = field(default_factory=list)
    first_round_end: float | None = None
    n_cached: int = 0  # prompt tokens the first round's slot had cached
    # the next round's other slots catch up: on a plain run's tokens, or on the whole
    # prompt where the first round prefilled one slot only and copied none
    after_run: bool = False
    # while the other slots lag behind the one that holds the whole context
    # (`SlotCopies.fullest`): by how many tokens at least (fresh prompt tokens, plain-run
    # tokens)
    lag: int = 0
    # the last round while its choice to draft ahead awaits the next round's draft
    awaiting_overlap: RoundRecord | None = None
