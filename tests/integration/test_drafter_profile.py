"""scripts/drafter_profile.py: ONNX Runtime's profiler around the product's runner.

It splits the profile's runs into phases by count, so the counts must be the runner's:
a prompt of L tokens in runs of `prefill_chunk`, then one run per draft step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from npu_draft.onnx_runner import OnnxDraftModel
from tests.support.scripts import run_script


def test_profile_counts_the_runner_s_runs_and_names_each_operator_s_provider(
    demo_models: Path, tmp_path: Path
) -> None:
    out = tmp_path / "profile.json"
    run_script(
        "drafter_profile",
        f"{demo_models / 'draft'} --provider cpu --length 70 --prefill-chunk 32 --steps 5 -o {out}",
    )
    result = json.loads(out.read_text())
    assert result["provider"] == "cpu" and result["prefill_chunk"] == 32
    assert result["prefill"]["runs"] == math.ceil(70 / 32)
    assert result["steps"]["runs"] == 5
    for phase in ("prefill", "steps"):
        assert result[phase]["node_ms_by_provider"]["CPU"] > 0
        assert any(op.endswith("MatMul") for op in result[phase]["top_ops_ms"])
    assert result["placement"]["GroupQueryAttention"] == ["CPUExecutionProvider"]


def test_profiling_is_off_unless_asked(demo_models: Path) -> None:
    model = OnnxDraftModel(demo_models / "draft", "cpu", max_context=64)
    session = model.open_session()
    session.sync([1, 2, 3])
    session.close()
    model.close()
    assert model.profile_path is None
