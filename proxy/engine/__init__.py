"""The speculative engine: one generation's rounds against a stock llama-server.

- `generation`: the loop, choosing a plain run or a speculative round each time.
- `rounds`: the two kinds of round, the speculative one as named steps.
- `proposer`: where a round's draft comes from, the one object the rounds ask for
  drafts (now, prepared early, drafted ahead), each drafter call bounded once.
- `drafting`: what a drafter offers the proposer, and the adapter of a draft session.
- `rules`: the greedy or the sampling rule (verify and accept), chosen once per generation.
- `slot_copies`: copying the slot that holds the context into the others.
- `decode_check`: one server decode per verify round, counted.
- `loop_state`, `settings`: what the loop keeps and is given (its records: `proxy.data`).
- `background`: the work generations leave running, owned by the proxy.

The measured choices (draft length, drafting ahead, plain runs) are `proxy.policies`.
"""

from proxy.data.records import GenerationResult, RoundObserver, RoundRecord
from proxy.engine.decode_check import DecodeCountError
from proxy.engine.drafting import AsyncDrafter, AsyncSessionDrafter
from proxy.engine.generation import Generation
from proxy.engine.rules import verdict_of
from proxy.engine.settings import EngineSettings, GenerationParams
from proxy.engine.slot_copies import SlotReplicator

__all__ = [
    "AsyncDrafter",
    "AsyncSessionDrafter",
    "DecodeCountError",
    "EngineSettings",
    "Generation",
    "GenerationParams",
    "GenerationResult",
    "RoundObserver",
    "RoundRecord",
    "SlotReplicator",
    "verdict_of",
]
