"""The RPC helpers without llama.cpp: --rpc parsing, log parsing, finding the binary,
and reading a real local process's --rpc from /proc (what doctor reports)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy import doctor
from proxy.server import rpc, server_install

LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def listener():
    """Start a real local process that listens on a port with the given argv tail."""
    started: list[subprocess.Popen] = []

    def start(*argv: str, env: dict[str, str] | None = None) -> tuple[int, int]:
        process = subprocess.Popen(
            [sys.executable, "-c", LISTENER, *argv], stdout=subprocess.PIPE, text=True, env=env
        )
        started.append(process)
        port = int(process.stdout.readline())
        return process.pid, port

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_rpc_endpoints_from_argv_and_env() -> None:
    argv = ["llama-server", "-m", "x.gguf", "--rpc", "10.0.0.2:50052, 10.0.0.3:50052"]
    assert rpc.rpc_endpoints(argv) == ["10.0.0.2:50052", "10.0.0.3:50052"]
    assert rpc.rpc_endpoints(["llama-server", "--rpc=h:1"]) == ["h:1"]
    assert rpc.rpc_endpoints(["llama-server"], {"LLAMA_ARG_RPC": "h:2"}) == ["h:2"]
    assert rpc.rpc_endpoints(["llama-server", "-m", "x.gguf"]) == []


def test_rpc_devices_in_log() -> None:
    text = (
        "load_tensors:   RPC0[127.0.0.1:41001] model buffer size =    60.00 MiB\n"
        "load_tensors:   RPC1[127.0.0.1:41002] model buffer size =    58.00 MiB\n"
        "llama_kv_cache:   RPC0[127.0.0.1:41001] KV buffer size =  12.00 MiB\n"
        "load_tensors:   CPU_Mapped model buffer size =    10.00 MiB\n"
    )
    assert rpc.rpc_devices_in_log(text) == ["RPC0[127.0.0.1:41001]", "RPC1[127.0.0.1:41002]"]


def test_local_process_with_rpc_is_found(listener) -> None:
    pid, port = listener("--rpc", "127.0.0.1:50052,127.0.0.1:50053")
    use = rpc.local_rpc_use(f"http://127.0.0.1:{port}")
    assert use == rpc.RpcUse(pid, ["127.0.0.1:50052", "127.0.0.1:50053"])
    assert rpc.local_rpc_use(f"localhost:{port}") == use  # no scheme: as doctor accepts
    lines = doctor.rpc_report(f"http://localhost:{port}")
    assert len(lines) == 1 and "[ok]" in lines[0] and "127.0.0.1:50053" in lines[0]


def test_local_process_without_rpc_reports_nothing(listener) -> None:
    _, port = listener("-m", "model.gguf")
    assert rpc.local_rpc_use(f"http://127.0.0.1:{port}") is None
    assert doctor.rpc_report(f"http://127.0.0.1:{port}") == []


def test_remote_or_absent_upstream_is_not_guessed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert rpc.local_rpc_use(f"http://127.0.0.1:{free}") is None  # nobody listens
    assert rpc.local_rpc_use("http://192.0.2.1:8080") is None  # TEST-NET: not this host


def test_missing_rpc_server_says_how_to_get_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NPU_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(rpc.RPC_SERVER_ENV, raising=False)
    with pytest.raises(rpc.RpcServerNotFound, match="install-server"):
        rpc.find_rpc_server()
    monkeypatch.setenv(rpc.RPC_SERVER_ENV, str(tmp_path / "nope"))
    with pytest.raises(rpc.RpcServerNotFound, match="nope"):
        rpc.find_rpc_server()
    cached = server_install.cached_rpc_server_path()
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    monkeypatch.delenv(rpc.RPC_SERVER_ENV)
    assert rpc.find_rpc_server() == cached


async def test_process_start_fails_clearly_when_the_binary_exits(tmp_path: Path) -> None:
    failing = tmp_path / "ggml-rpc-server"
    failing.write_text("#!/bin/sh\necho 'No devices found' >&2\nexit 1\n")
    failing.chmod(0o755)
    server = rpc.RpcServerProcess(failing, log_path=tmp_path / "rpc.log")
    started = time.monotonic()
    with pytest.raises(rpc.RpcServerStartError, match="exited with code 1"):
        await server.start(timeout=20)
    assert time.monotonic() - started < 15
    assert not server.running


async def test_delay_relay_holds_each_direction_and_keeps_bytes() -> None:
    """A request-response through the relay gains twice the one-way delay; the bytes
    arrive whole and in order."""
    import asyncio

    from proxy.bench.rpc_stack import DelayRelay

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = DelayRelay("127.0.0.1", port, delay_s=0.02)
    await relay.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        payload = bytes(range(256)) * 1000
        loop = asyncio.get_running_loop()
        started = loop.time()
        writer.write(payload)
        await writer.drain()
        got = await reader.readexactly(len(payload))
        elapsed = loop.time() - started
        assert got == payload
        assert elapsed >= 0.04, elapsed
        writer.close()
    finally:
        await relay.stop()
        server.close()
