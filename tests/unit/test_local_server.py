"""Reading -kvu from a llama-server command line, and finding a local listener."""

from __future__ import annotations

import os
import socket

import pytest

from proxy.server.local_server import kv_unified, listening_process, local_server_command


@pytest.mark.parametrize(
    ("argv", "environ", "unified"),
    [
        (["llama-server", "-np", "6", "-kvu"], {}, True),
        (["llama-server", "-np", "6", "--kv-unified"], {}, True),
        (["llama-server", "-np", "6"], {}, False),
        (["llama-server", "-np", "6", "-kvu", "-no-kvu"], {}, False),
        (["llama-server", "-np", "6"], {"LLAMA_ARG_KV_UNIFIED": "on"}, True),
        (["llama-server", "-np", "6", "-no-kvu"], {"LLAMA_ARG_KV_UNIFIED": "1"}, False),
        (["llama-server"], {}, True),  # -np auto turns it on (b11434 server.cpp)
        (["llama-server", "--parallel=-1"], {}, True),
        (["llama-server"], {"LLAMA_ARG_N_PARALLEL": "3"}, False),
    ],
)
def test_kv_unified_as_llama_server_decides(argv, environ, unified) -> None:
    assert kv_unified(argv, environ) is unified


def test_the_listening_process_of_a_port_is_found() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listening_process(port) == os.getpid()
        found = local_server_command(f"http://127.0.0.1:{port}")
        assert found is not None and "pytest" in " ".join(found[0])
    assert local_server_command("http://example.invalid:8080") is None  # not this machine
