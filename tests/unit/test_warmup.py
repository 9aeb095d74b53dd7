"""The drafter warm-up: a first session's costs are paid before anything is timed."""

from __future__ import annotations

import logging

import pytest

from npu_draft.protocol import Draft
from npu_draft.warmup import warm_up


class RecordingModel:
    def __init__(self, fail: bool = False, **runner_facts: int) -> None:
        self.calls: list[str] = []
        self.fail = fail
        for name, value in runner_facts.items():  # prefill_chunk, max_context
            setattr(self, name, value)

    def open_session(self):
        model = self

        class Session:
            def sync(self, tokens):
                model.calls.append(f"sync {len(tokens)}")

            def propose(self, k, *args, **kwargs):
                if model.fail:
                    raise RuntimeError("the NPU said no")
                model.calls.append(f"propose {k}")
                return Draft([1] * k)

            def close(self):
                model.calls.append("close")

        return Session()


def test_warm_up_drafts_rewinds_drafts_again_and_closes_its_session():
    model = RecordingModel()
    assert warm_up(model) >= 0.0
    assert model.calls == ["sync 16", "propose 4", "sync 15", "propose 4", "close"]


def test_the_warm_up_prompt_fills_one_prefill_chunk_within_the_context():
    chunked = RecordingModel(prefill_chunk=512, max_context=4096)
    warm_up(chunked)
    assert chunked.calls[:3] == ["sync 512", "propose 4", "sync 511"]
    short = RecordingModel(prefill_chunk=512, max_context=100)
    warm_up(short)
    assert short.calls[0] == "sync 95"  # 4 drafts and the bonus token still fit


def test_a_runner_may_ask_for_a_warm_up_over_its_whole_context():
    whole = RecordingModel(prefill_chunk=512, max_context=4096, warm_up_length=4096)
    warm_up(whole)
    assert whole.calls[0] == "sync 4091"


def test_a_failing_warm_up_is_a_warning_and_still_closes(caplog: pytest.LogCaptureFixture):
    model = RecordingModel(fail=True)
    with caplog.at_level(logging.WARNING, logger="npu_draft.warmup"):
        warm_up(model)
    assert model.calls == ["sync 16", "close"]
    assert "warming the drafter up failed" in caplog.text


@pytest.mark.parametrize("backend", ["onnx", "genai"])
def test_warm_up_runs_on_the_factory_drafter(
    demo_models, backend: str, caplog: pytest.LogCaptureFixture
):
    from npu_draft.load import load_drafter

    model = load_drafter(demo_models / "draft", "cpu", backend=backend)
    try:
        with caplog.at_level(logging.WARNING, logger="npu_draft.warmup"):
            warm_up(model)
        assert "up failed" not in caplog.text
    finally:
        model.close()
