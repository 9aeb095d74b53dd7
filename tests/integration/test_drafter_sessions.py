"""scripts/drafter_sessions.py: each request's prompt intake and draft steps, through
the product's pooled worker threads and through a new thread per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npu_draft.async_session import WORKERS
from tests.support.scripts import run_script


def test_both_ways_time_every_request_and_the_pooled_way_makes_no_new_thread(
    demo_models: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sessions.json"
    threads_before = WORKERS.created
    run_script(
        "drafter_sessions",
        f"{demo_models / 'draft'} --provider cpu --length 40 -k 3 --requests 3 -o {out}",
    )
    result = json.loads(out.read_text())
    assert result["provider"] == "cpu" and result["length"] == 40
    assert set(result["ways"]) == {"pooled", "fresh"}
    for way in result["ways"].values():
        assert len(way["intake_ms"]) == len(way["step_ms"]) == 3
        assert all(ms > 0 for ms in way["intake_ms"] + way["step_ms"])
    # the warm-up and three requests one after another: at most one new pooled thread
    assert WORKERS.created - threads_before <= 1


def test_a_prompt_that_fills_the_context_is_refused(
    demo_models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from npu_draft.onnx_runner import OnnxDraftModel

    context = OnnxDraftModel(demo_models / "draft", "cpu").max_context
    with pytest.raises(SystemExit):
        run_script(
            "drafter_sessions", f"{demo_models / 'draft'} --provider cpu --length {context} -k 3"
        )
    assert "the context" in capsys.readouterr().err


def test_graph_settings_run_side_by_side(demo_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "graphs.json"
    run_script(
        "drafter_sessions",
        f"{demo_models / 'draft'} --provider cpu --length 30 -k 3 --requests 2 "
        f"--ways pooled --graphs off,on -o {out}",
    )
    result = json.loads(out.read_text())
    # on the CPU the fixed-buffer steps run uncaptured, so "on" holds
    assert result["graphs"] == {"off": False, "on": True}
    assert set(result["ways"]) == {"pooled, graphs off", "pooled, graphs on"}
    assert all(len(way["step_ms"]) == 2 for way in result["ways"].values())
