"""`npu-spec doctor` tells the truth about this machine and about a real server."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import onnxruntime
import pytest

from proxy import doctor
from proxy.llama_server import server_version


def _run_doctor(**overrides) -> tuple[int, str]:
    args = argparse.Namespace(llama_server=None, upstream=None, k=4, conversations=1)
    for key, value in overrides.items():
        setattr(args, key, value)
    lines: list[str] = []
    code = doctor.run(args, echo=lines.append)
    return code, "\n".join(lines)


def test_reports_binary_version_and_providers(llama_server_bin: Path) -> None:
    code, text = _run_doctor()
    assert code == 0
    assert f"llama-server: {llama_server_bin}" in text
    assert server_version(llama_server_bin) in text and "11434" in text
    for provider in onnxruntime.get_available_providers():
        assert provider in text
    has_npu = "VitisAIExecutionProvider" in onnxruntime.get_available_providers()
    assert ("NPU: yes" in text) == has_npu and ("NPU: no" in text) != has_npu


def test_missing_binary_is_reported_not_crashed(tmp_path: Path) -> None:
    code, text = _run_doctor(llama_server=str(tmp_path / "absent"))
    assert code == 1
    assert "MISSING" in text and "install-server" in text


@pytest.mark.server
async def test_upstream_check_names_the_flags_to_fix(demo_models: Path, start_server) -> None:
    plain = await start_server(demo_models / "target.gguf")  # default flags: 1 slot etc.
    code, text = await asyncio.to_thread(_run_doctor, upstream=plain.base_url)
    assert code == 1
    assert "FAIL" in text
    for flag in ("-np", "--metrics"):
        assert flag in text


@pytest.mark.server
async def test_upstream_check_passes_a_well_configured_server(
    demo_models: Path, start_server
) -> None:
    flags = ["-np", "5", "-kvu", "--no-cache-idle-slots", "-cram", "0", "--metrics"]
    good = await start_server(demo_models / "target.gguf", flags, ctx=5 * 2048)
    code, text = await asyncio.to_thread(_run_doctor, upstream=good.base_url, k=4)
    assert code == 0, text
    assert "FAIL" not in text
