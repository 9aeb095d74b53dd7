"""Warm a freshly loaded drafter up before anything is timed.

A runtime's first runs of a session pay one-time costs: memory planning, kernel
selection, and on an NPU loading the compiled model. The proxy times the drafter once,
beside the first request's plain runs, and a drafter too slow to win is ruled out for
good, so those costs must not land in that timing. On the 2-core machine a fresh
GenAI session's first draft took 14 ms a token, its first rewind 60, and later drafts
5 (docs/BENCHMARKS.md, "Measurements behind design choices").
"""

from __future__ import annotations

import logging
import time

from npu_draft.protocol import DraftModel

log = logging.getLogger(__name__)

# token ids every vocabulary has; the text they make does not matter
_WARMUP_TOKENS = list(range(1, 17))
_WARMUP_DRAFTS = 4


def warm_up(model: DraftModel) -> float:
    """Draft a few tokens in a new session, rewind and draft again (the path every
    round after a rejection takes), then close it; returns the ms it took. A failure
    is logged, not raised: the first request finds a broken drafter just the same."""
    started = time.perf_counter()
    try:
        session = model.open_session()
        try:
            session.sync(_WARMUP_TOKENS)
            session.propose(_WARMUP_DRAFTS)
            session.sync([*_WARMUP_TOKENS[:-2], _WARMUP_TOKENS[0]])
            session.propose(_WARMUP_DRAFTS)
        finally:
            session.close()
    except Exception:  # any backend's failure: only the timing is at stake
        log.warning("warming the drafter up failed; its first timing may be slow", exc_info=True)
    return (time.perf_counter() - started) * 1e3
