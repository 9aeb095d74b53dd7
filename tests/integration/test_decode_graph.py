"""The fixed-buffer decode steps that CUDA replays as graphs (`npu_draft.decode_graph`),
run uncaptured on the CPU against the runner's plain steps, and the slots they keep
(`npu_draft.kv_slots`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from npu_draft.decode_graph import DecodeGraph
from npu_draft.onnx_runner import OnnxDraftModel, OnnxDraftSession

CONTEXT = 256


@pytest.fixture(scope="module")
def graphed_model(demo_models: Path) -> Iterator[OnnxDraftModel]:
    model = OnnxDraftModel(demo_models / "draft", "cpu", max_context=CONTEXT, cuda_graphs=True)
    yield model
    model.close()


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 151_000, length).tolist()


def test_fixed_buffer_steps_give_the_plain_steps_logits(graphed_model) -> None:
    graphed = graphed_model.open_session()
    plain = OnnxDraftSession(graphed_model, graphed=False)
    try:
        tokens = prompt(1, 40)
        for session in (graphed, plain):
            session.sync(tokens)
        assert graphed._slot.graph is not None and plain._slot.graph is None
        # drafting, a rollback to a shorter prefix, a new branch, drafting again
        for step in ("draft", "draft", "rollback", "branch", "draft"):
            if step == "draft":
                got, expected = graphed.propose(5).tokens, plain.propose(5).tokens
                assert got == expected
            else:
                cut = tokens[:25] if step == "rollback" else [*tokens[:25], 4242]
                for session in (graphed, plain):
                    session.sync(cut)
            np.testing.assert_allclose(
                graphed.next_logits(), plain.next_logits(), rtol=1e-5, atol=1e-5
            )
    finally:
        graphed.close()
        plain.close()


def test_a_closed_sessions_slot_is_lent_again_first_on_its_own_thread(demo_models) -> None:
    graphed_model = OnnxDraftModel(
        demo_models / "draft", "cpu", max_context=CONTEXT, cuda_graphs=True
    )
    try:
        check_slot_reuse(graphed_model)
    finally:
        graphed_model.close()


def check_slot_reuse(graphed_model: OnnxDraftModel) -> None:
    def session_on_new_thread() -> OnnxDraftSession:
        opened: list[OnnxDraftSession] = []

        def run() -> None:
            session = graphed_model.open_session()
            session.sync(prompt(2, 10))
            opened.append(session)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return opened[0]

    other = session_on_new_thread()
    mine = graphed_model.open_session()
    mine.sync(prompt(3, 10))
    mine_slot, other_slot = mine._slot, other._slot
    created = graphed_model._slots.created
    mine.close()  # closed last, but `other`'s slot was run on another thread
    other.close()
    again = graphed_model.open_session()
    again.sync(prompt(4, 10))
    assert again._slot is mine_slot
    assert graphed_model._slots.created == created  # no new cache allocated
    assert again.propose(3).tokens  # the slot drafts for its new sequence
    again.close()
    assert other_slot in graphed_model._slots._idle


def test_the_load_check_turns_graphs_down_when_steps_disagree(graphed_model, monkeypatch) -> None:
    assert graphed_model._decode_graphs_agree()
    real_step = DecodeGraph.step

    def wrong_step(self, token: int, past_length: int) -> np.ndarray:
        logits = real_step(self, token, past_length)
        return logits + np.linspace(0, 1, logits.size, dtype=np.float32)

    monkeypatch.setattr(DecodeGraph, "step", wrong_step)
    assert not graphed_model._decode_graphs_agree()

    def failing_step(self, token: int, past_length: int) -> np.ndarray:
        raise RuntimeError("cudaErrorStreamCaptureUnsupported")

    monkeypatch.setattr(DecodeGraph, "step", failing_step)
    assert not graphed_model._decode_graphs_agree()


def test_off_by_default_on_the_cpu_where_slots_are_freed_at_close(demo_models: Path) -> None:
    model = OnnxDraftModel(demo_models / "draft", "cpu", max_context=CONTEXT)
    try:
        assert not model.graphs
        session = model.open_session()
        session.sync(prompt(5, 12))
        assert session._slot.graph is None
        session.close()
        assert model._slots._idle == []
    finally:
        model.close()


def test_a_session_dropped_unclosed_gives_its_slot_back_and_a_closed_one_refuses_work(
    graphed_model,
) -> None:
    session = graphed_model.open_session()
    session.sync(prompt(6, 12))
    slot = session._slot
    del session  # never closed, as after a request that failed before its cleanup
    assert slot in graphed_model._slots._idle
    closed = graphed_model.open_session()
    closed.sync(prompt(7, 12))
    closed.close()
    with pytest.raises(RuntimeError, match="after close"):
        closed.sync(prompt(7, 13))


def test_the_model_is_freed_with_its_last_reference_and_keeps_no_slot_after_close(
    demo_models: Path,
) -> None:
    import gc
    import weakref

    model = OnnxDraftModel(demo_models / "draft", "cpu", max_context=CONTEXT, cuda_graphs=True)
    session = model.open_session()
    session.sync(prompt(8, 12))
    pool = model._slots
    model.close()
    session.close()  # after its model: the slot is dropped, not kept
    assert pool._idle == []
    gone = weakref.ref(model)
    gc.disable()  # freed by reference counting, as `LoadedDrafter.reload` relies on
    try:
        del model, session
        assert gone() is None
    finally:
        gc.enable()
