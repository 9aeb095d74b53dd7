"""A drafter graph run for B sequences at once gives each row the logits it gets alone.

Multi-outcome drafting (issue 29) would draft several candidate lines in one run; the
lines have different lengths (all drafts accepted, or j accepted and then the runner-up),
so the check uses rows of different cached lengths. A tiny random Qwen3 graph written
by the project's own writer, on the CPU provider.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from npu_draft.batch_step import BatchStep, batch_axis, random_drafter
from npu_draft.factory.shapes import ModelShape

TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, head_dim=16, vocab=97)
CAPACITY = 32


def _session(folder: Path, float16: bool) -> ort.InferenceSession:
    path = random_drafter(TINY, folder, context=CAPACITY, seed=3, float16=float16)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _cache_after(session: ort.InferenceSession, history: list[int]) -> dict[str, np.ndarray]:
    """One sequence's cache after feeding `history` token by token, and its last logits."""
    alone = BatchStep(session, 1, CAPACITY)
    for position, token in enumerate(history):
        alone.step([token], [position])
    return {name: value.numpy().copy() for name, value in alone.buffers.items()}


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
def test_rows_of_different_lengths_match_single_runs(tmp_path: Path, float16: bool) -> None:
    session = _session(tmp_path, float16)
    assert batch_axis(session) is None, "the writer's graph has a dynamic batch axis"
    rng = np.random.default_rng(0)
    histories = [list(rng.integers(0, TINY.vocab, n)) for n in (7, 12, 3, 12)]
    nexts = [int(t) for t in rng.integers(0, TINY.vocab, len(histories))]
    caches = [_cache_after(session, h) for h in histories]

    batched = BatchStep(session, len(histories), CAPACITY)
    batched.fill({name: np.concatenate([c[name] for c in caches]) for name in caches[0]})
    assert all(np.abs(v.numpy()).max() > 0 for v in batched.buffers.values()), "caches filled"
    together = batched.step(nexts, [len(h) for h in histories])

    tolerance = 2e-2 if float16 else 1e-4
    for row, (history, token) in enumerate(zip(histories, nexts, strict=True)):
        alone = BatchStep(session, 1, CAPACITY)
        alone.fill(caches[row])
        expected = alone.step([token], [len(history)])[0]
        assert np.abs(together[row] - expected).max() < tolerance * np.abs(expected).max(), row
        assert int(np.argmax(together[row])) == int(np.argmax(expected))
    # the rows really differ: a graph that broadcast row 0 would fail above, not pass here
    assert len({int(np.argmax(r)) for r in together}) > 1 or not np.allclose(
        together[0], together[1]
    )
