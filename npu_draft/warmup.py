"""Warm a freshly loaded drafter up before anything is timed.

A runtime's first runs of a session pay one-time costs: memory planning, kernel
selection, and on an NPU loading the compiled model. The proxy times the drafter once,
beside the first request's plain runs, and a drafter too slow to win is ruled out for
good, so those costs must not land in that timing. On the 2-core machine a fresh
GenAI session's first draft took 14 ms a token, its first rewind 60, and later drafts
5 (docs/BENCHMARKS.md, "Measurements behind design choices").

The prompt fills one whole prefill chunk where the runner feeds prompts in chunks: a
runtime sizes its memory and picks its kernels for the largest run it has seen. On an
H100 (CUDA, fp16 0.6B-shape) a session's first 512-token prompt took 1.2 s after a
16-token warm-up, and 6 ms after that (`scripts/drafter_sessions.py`). With the chunk
warm-up a first 512-token prompt took 6 ms, but a first 4,000-token one still 1.0-1.1 s
(37-40 ms after it): on CUDA the runner asks for a warm-up over its whole context.
"""

from __future__ import annotations

import logging
import time

from npu_draft.protocol import DraftModel

log = logging.getLogger(__name__)

# token ids every vocabulary has; the text they make does not matter
_WARMUP_TOKENS = list(range(1, 17))
_WARMUP_DRAFTS = 4


def _warm_up_prompt(model: DraftModel) -> list[int]:
    """`_WARMUP_TOKENS` repeated to the runner's `warm_up_length` where it gives one, else
    to one prefill chunk (its `prefill_chunk`), leaving room in the context for the
    drafts."""
    length = max(
        len(_WARMUP_TOKENS),
        getattr(model, "warm_up_length", 0) or getattr(model, "prefill_chunk", 0) or 0,
    )
    max_context = getattr(model, "max_context", None)
    if max_context:
        length = max(2, min(length, max_context - _WARMUP_DRAFTS - 1))
    return [_WARMUP_TOKENS[i % len(_WARMUP_TOKENS)] for i in range(length)]


def warm_up(model: DraftModel) -> float:
    """Draft a few tokens in a new session, rewind and draft again (the path every
    round after a rejection takes), then close it; returns the ms it took. A failure
    is logged, not raised: the first request finds a broken drafter just the same."""
    started = time.perf_counter()
    try:
        session = model.open_session()
        try:
            prompt = _warm_up_prompt(model)
            session.sync(prompt)
            session.propose(_WARMUP_DRAFTS)
            session.sync([*prompt[:-2], prompt[0]])
            session.propose(_WARMUP_DRAFTS)
        finally:
            session.close()
    except Exception:  # any backend's failure: only the timing is at stake
        log.warning("warming the drafter up failed; its first timing may be slow", exc_info=True)
    return (time.perf_counter() - started) * 1e3
