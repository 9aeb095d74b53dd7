"""A user's mistakes get one line on stderr that names the fix, never a traceback, and
`serve` finds them before it starts llama-server or loads a drafter."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import ProxySettings

REPO = Path(__file__).resolve().parents[2]


def npu_spec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh process, stderr captured."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SPEC_")}
    environ.update(env or {}, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
        cwd=REPO,
    )


def one_line_error(result: subprocess.CompletedProcess, command: str = "serve") -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"npu-spec {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_neither_target_nor_upstream_names_both_options() -> None:
    line = one_line_error(npu_spec("serve"))
    assert "--target" in line and "--upstream" in line


def test_both_target_and_upstream_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    line = one_line_error(npu_spec("serve", "--target", str(model), "--upstream", "x:1"))
    assert "exactly one" in line


def test_a_missing_model_is_named(tmp_path: Path) -> None:
    line = one_line_error(npu_spec("serve", "--target", str(tmp_path / "absent.gguf")))
    assert "absent.gguf does not exist" in line and "fix:" in line


def test_an_out_of_range_option_names_the_flag_and_variable() -> None:
    line = one_line_error(npu_spec("serve", "--upstream", "localhost:1", "-k", "40"))
    assert "-k (NPU_SPEC_K)" in line and "16" in line
    line = one_line_error(npu_spec("serve", "--upstream", "x:1", "--draft-timeout", "-1"))
    assert "--draft-timeout (NPU_SPEC_DRAFT_TIMEOUT_S)" in line


def test_a_bad_environment_variable_is_named() -> None:
    line = one_line_error(npu_spec("serve", env={"NPU_SPEC_UPSTREAM": "x:1", "NPU_SPEC_K": "x"}))
    assert "NPU_SPEC_K" in line


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    line = one_line_error(npu_spec("serve", "--config", str(tmp_path / "npu-spec.toml")))
    assert "npu-spec.toml" in line


def test_a_missing_drafter_folder_is_named() -> None:
    line = one_line_error(npu_spec("serve", "--upstream", "x:1", "--drafter", "/no/such/dir"))
    assert "/no/such/dir" in line and "export-drafter" in line


def test_an_upstream_url_of_another_scheme_is_refused_with_an_example() -> None:
    line = one_line_error(npu_spec("serve", "--upstream", "ftp://host:21"))
    assert "http://127.0.0.1:8081" in line


def test_a_scheme_less_upstream_gets_http() -> None:
    assert ProxySettings(upstream="localhost:8081").upstream == "http://localhost:8081"
    assert ProxySettings(upstream="https://h:1/").upstream == "https://h:1"


def test_a_busy_port_is_found_before_llama_server_starts(tmp_path: Path, busy_port: int) -> None:
    # the "model" is not a GGUF and the "binary" records whether it ran: had the
    # proxy started llama-server first, the marker would exist
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a model")
    marker = tmp_path / "started"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ntouch {marker}\nsleep 30\n")
    binary.chmod(0o755)
    line = one_line_error(
        npu_spec("serve", "--target", str(model), "--llama-server", str(binary),
                 "--port", str(busy_port))
    )  # fmt: skip
    assert f"port {busy_port} on 127.0.0.1 is already in use" in line and "--port" in line
    assert not marker.exists()


def test_a_busy_server_port_is_found_too(tmp_path: Path, busy_port: int) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a model")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    line = one_line_error(
        npu_spec("serve", "--target", str(model), "--llama-server", str(binary), "--port", "0",
                 "--server-port", str(busy_port))
    )  # fmt: skip
    assert "--server-port" in line


def test_a_busy_port_is_found_before_attaching(busy_port: int) -> None:
    # port 9 (discard) has no llama-server: had the proxy tried it first, the error
    # would be about the upstream
    line = one_line_error(npu_spec("serve", "--upstream", "127.0.0.1:9", "--port", str(busy_port)))
    assert "already in use" in line


def test_a_missing_llama_server_binary_is_named(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    result = npu_spec(
        "serve", "--target", str(model), "--llama-server", str(tmp_path / "nope"), "--port", "0"
    )
    assert "install-server" in one_line_error(result)


def test_a_server_that_fails_to_start_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a model")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 1\n")
    binary.chmod(0o755)
    log = tmp_path / "server.log"
    result = npu_spec(
        "serve", "--target", str(model), "--llama-server", str(binary), "--port", "0",
        "--server-log", str(log),
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "exited with code 1" in result.stderr and "cannot load model" in result.stderr


def test_nothing_listening_at_the_upstream_is_named() -> None:
    from proxy.server.llama_server import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    line = one_line_error(npu_spec("serve", "--upstream", url, "--port", "0"))
    assert f"nothing answers at {url} (connection refused): is llama-server running there?" in line
    assert "flags" not in line and "attach-policy" not in line  # no flag can fix it
    result = npu_spec("doctor", "--upstream", url)
    assert result.returncode == 1
    assert f"upstream {url}: UNREACHABLE - nothing answers at {url}" in result.stdout
