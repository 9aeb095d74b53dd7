"""`npu-spec doctor` tells the truth about this machine and about a real server."""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
from pathlib import Path
from typing import Any

import gguf
import onnxruntime
import pytest

from proxy import doctor
from proxy.server.llama_server import server_version
from proxy.user_errors import UserError


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


def test_a_scheme_less_upstream_is_tried_over_http() -> None:
    # nothing listens on port 9: the report must name the http:// URL it tried
    code, text = _run_doctor(upstream="127.0.0.1:9")
    assert code == 1
    assert "http://127.0.0.1:9" in text and "NonHttpUrl" not in text


def test_an_upstream_of_another_scheme_is_refused_with_a_hint() -> None:
    code, text = _run_doctor(upstream="ftp://127.0.0.1:9")
    assert code == 1 and "FAIL" in text and "http://" in text


def _plan(model: Path, k: int, ctx: int, type_k: str = "f16") -> list[str]:
    args = argparse.Namespace(
        plan=True, model=str(model), k=k, ctx=ctx, conversations=1, passthrough_slots=1,
        cache_type_k=type_k, cache_type_v="f16", slot_save_path="SLOTS",
    )  # fmt: skip
    lines: list[str] = []
    assert doctor.run(args, echo=lines.append) == 0
    return lines


def test_plan_without_a_model_names_the_option() -> None:
    args = argparse.Namespace(plan=True, model=None, k=4, ctx=4096)
    with pytest.raises(UserError, match="--model"):
        doctor.run(args)


@pytest.mark.server
@pytest.mark.parametrize(("k", "ctx", "type_k"), [(4, 1024, "f16"), (2, 700, "q8_0")])
async def test_plan_matches_the_kv_cache_llama_server_allocates(
    demo_models: Path, start_server, tmp_path: Path, k: int, ctx: int, type_k: str
) -> None:
    """Start llama-server with exactly the printed flags; its own log line
    `llama_kv_cache: size = X MiB (N cells, ...)` must say what the plan said."""
    lines = _plan(demo_models / "target.gguf", k, ctx, type_k)
    planned = re.search(r"KV cache: ([\d.]+) MiB for (\d+) cells", "\n".join(lines))
    assert planned is not None, lines
    command = shlex.split(lines[-1])
    assert command[:3] == ["llama-server", "-m", str(demo_models / "target.gguf")]
    flags = [str(tmp_path) if arg == "SLOTS" else arg for arg in command[3:]]
    flags += ["-lv", "4"]  # llama_kv_cache's size line is logged at verbosity 4 (trace)
    server = await start_server(demo_models / "target.gguf", flags)
    # the log file is appended to by every run of this test: read this run's part
    log = server.log_path.read_text(errors="replace").split("load_model: loading model")[-1]
    reported = re.findall(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells", log)
    assert len(reported) == 1, log[-3000:]
    assert reported[0] == planned.groups(), (reported, lines)
    # and the slots are what the plan promised
    props = await _get_json(server.base_url + "/props")
    assert props["total_slots"] == k + 2
    assert props["default_generation_settings"]["n_ctx"] == -(-ctx // 256) * 256


async def _get_json(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


def _metadata_only_gguf(path: Path, layers: int, heads: int, kv_heads: int, head: int) -> Path:
    """A GGUF with a published model's attention shape and no weights: enough for
    the plan, which reads only metadata."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_embedding_length(5120)  # Qwen3-32B: not heads x head size, so unused
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_quickstart_shows_what_the_plan_prints(tmp_path: Path) -> None:
    """docs/QUICKSTART.md quotes the plan for Qwen3-32B (64 layers, 8 KV heads of 128)."""
    model = _metadata_only_gguf(tmp_path / "Qwen3-32B-Q4_K_M.gguf", 64, 64, 8, 128)
    args = argparse.Namespace(
        plan=True, model=str(model), k=4, ctx=8192, conversations=1, passthrough_slots=1,
        cache_type_k="f16", cache_type_v="f16", slot_save_path="/tmp/npu-spec-slots",
    )  # fmt: skip
    lines: list[str] = []
    assert doctor.run(args, echo=lines.append) == 0
    quickstart = (Path(__file__).parents[2] / "docs" / "QUICKSTART.md").read_text()
    shown = str(model)
    for line in lines:
        assert line.replace(shown, "/home/you/models/Qwen3-32B-Q4_K_M.gguf") in quickstart, line
    assert "12288.00 MiB for 49152 cells" in lines[2]


async def _doctor_on(server: Any) -> tuple[Any, int, str]:
    """Start `server`, run `doctor --upstream` (k = 4) against it, stop it."""
    await server.start()
    try:
        code, text = await asyncio.to_thread(_run_doctor, upstream=server.base_url, k=4)
    finally:
        await server.stop()
    return server, code, text


def _restart_line(text: str) -> list[str] | None:
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.strip().startswith("restart llama-server with every flag it needs"):
            return shlex.split(lines[index + 1])
    return None


@pytest.mark.server
async def test_one_doctor_pass_names_every_flag_and_its_command_fixes_them(
    demo_models: Path, llama_server_bin: Path, tmp_path: Path
) -> None:
    """llama-server started with nothing but its model (and a small context, which only
    sizes the cache): one doctor run names every flag verification needs and prints one
    command line; the server started with that command passes every check."""
    from proxy.server.llama_server import LlamaServerProcess

    model = demo_models / "target.gguf"
    plain, code, text = await _doctor_on(
        LlamaServerProcess(llama_server_bin, model, ["-c", "1024"])
    )
    assert code == 1, text
    for flag in ("-np 6", "--metrics", "--no-cache-idle-slots -cram 0", "--slot-save-path"):
        assert f"fix: {flag}" in text, (flag, text)
    command = _restart_line(text)
    assert command is not None, text
    # the server's own command, with the verification flags
    assert command[:3] == [str(llama_server_bin), "-m", str(model)], command
    slots = tmp_path / "slots"
    slots.mkdir()
    own = {"-m": str(model), "--host": plain.host, "--port": str(plain.port)}
    args, items = [], iter(command[1:])
    for arg in items:
        if arg in own:
            assert next(items) == own[arg]
        else:
            args.append(str(slots) if arg == "/tmp/npu-spec-slots" else arg)
    assert args[:2] == ["-np", "6"], args  # its -c replaced by the planned one
    _, code, text = await _doctor_on(LlamaServerProcess(llama_server_bin, model, args))
    assert code == 0, text
    assert "FAIL" not in text and "WARN" not in text and _restart_line(text) is None, text
