"""llama.cpp's RPC backend: one model split across hosts, seen from the head host.

Each other host runs `ggml-rpc-server`; the head host runs an unmodified
`llama-server --rpc host:port,...` and the proxy in front of it. This module finds
and runs `ggml-rpc-server` (tests, benchmarks) and tells whether a local
llama-server uses RPC devices (doctor): the server's HTTP API names no devices, so
the answer comes from the command line of the process listening on its port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from proxy.server import server_install
from proxy.server.child_process import ChildProcess
from proxy.server.llama_server import free_port

log = logging.getLogger(__name__)

RPC_SERVER_ENV = "GGML_RPC_SERVER"


class RpcServerNotFound(RuntimeError):
    pass


class RpcServerStartError(RuntimeError):
    pass


def find_rpc_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The ggml-rpc-server binary: an explicit path, $GGML_RPC_SERVER, PATH (also the
    older name `rpc-server`), then the install-server cache; else raise saying how."""
    named = explicit or os.environ.get(RPC_SERVER_ENV)
    if named:
        path = Path(named).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise RpcServerNotFound(f"ggml-rpc-server not found at {path}")
    candidates = [shutil.which(server_install.RPC_SERVER_TARGET), shutil.which("rpc-server")]
    candidates.append(str(server_install.cached_rpc_server_path()))
    for value in candidates:
        if value and os.access(value, os.X_OK) and Path(value).is_file():
            return Path(value)
    raise RpcServerNotFound(
        "no ggml-rpc-server binary (looked at $GGML_RPC_SERVER, PATH and "
        f"{server_install.cached_rpc_server_path()}); `npu-spec install-server` builds it "
        "unless --cmake-args turns GGML_RPC off"
    )


class RpcServerProcess(ChildProcess):
    """One ggml-rpc-server child process exposing this host's devices (CPU when there
    is no accelerator) on host:port; ready once the port accepts connections."""

    name = "ggml-rpc-server"

    def __init__(
        self,
        binary: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        threads: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        super().__init__(binary, log_path)
        self.host = host
        self.port = port or free_port(host)
        self.threads = threads
        self.extra_args = list(extra_args)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        threads = ["-t", str(self.threads)] if self.threads else []
        return [str(self.binary), "-H", self.host, "-p", str(self.port), *threads, *self.extra_args]

    async def start(self, timeout: float = 60.0) -> None:
        await super().start(timeout)

    async def _wait_ready(self, timeout: float) -> None:
        # ggml-rpc-server serves one client at a time; a probe that connects and closes
        # at once is served and dropped before llama-server connects.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RpcServerStartError(
                    f"ggml-rpc-server exited with code {self.exit_code} during "
                    f"start-up; command: {' '.join(self.command)}"
                )
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(self.host, self.port)
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return
            await asyncio.sleep(0.1)
        raise RpcServerStartError(f"ggml-rpc-server did not listen on {self.endpoint}")


@contextlib.asynccontextmanager
async def rpc_servers(
    count: int,
    binary: Path | None = None,
    threads: int | None = None,
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
) -> AsyncIterator[list[RpcServerProcess]]:
    """`count` ggml-rpc-servers on `host` (one port each), all stopped on exit; pass
    `rpc_flag(servers)` to llama-server."""
    binary = binary or find_rpc_server()
    servers = [
        RpcServerProcess(
            binary,
            host=host,
            threads=threads,
            log_path=log_dir / f"rpc-server-{i}.log" if log_dir else None,
        )
        for i in range(count)
    ]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


def rpc_flag(servers: Sequence[RpcServerProcess]) -> list[str]:
    """llama-server arguments that put all model layers on these RPC servers."""
    return ["--rpc", ",".join(s.endpoint for s in servers), "-ngl", "99"]


# -- does a local llama-server use RPC devices? ---------------------------------------


@dataclass(frozen=True)
class RpcUse:
    pid: int
    endpoints: list[str]  # host:port of each ggml-rpc-server, in --rpc order


def rpc_endpoints(argv: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """The --rpc servers a llama-server command line (or its LLAMA_ARG_RPC) names."""
    value = (environ or {}).get("LLAMA_ARG_RPC", "")
    for i, arg in enumerate(argv):
        if arg == "--rpc" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--rpc="):
            value = arg.removeprefix("--rpc=")
    return [part.strip() for part in value.split(",") if part.strip()]


def rpc_devices_in_log(text: str) -> list[str]:
    """RPC device names (`RPC0[host:port]`) a llama-server log reports buffers on."""
    import re

    return sorted(set(re.findall(r"\bRPC\d+\[[^\]\s]+\]", text)))


def local_rpc_use(url: str, proc: Path = Path("/proc")) -> RpcUse | None:
    """RpcUse of the local process listening on `url`'s port, if it was started with
    --rpc; None when the upstream is not on this host, not visible (another user's
    process, no /proc) or not using RPC."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_local_host(parts.hostname or ""):
        return None
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return None
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (pid_dir / "fd").iterdir()}
        except OSError:
            continue
        if not any(f"socket:[{inode}]" in links for inode in inodes):
            continue
        try:
            argv = (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
            raw_env = (pid_dir / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return None
        environ = dict(item.partition("=")[::2] for item in raw_env if "=" in item)
        endpoints = rpc_endpoints(argv, environ)
        return RpcUse(int(pid_dir.name), endpoints) if endpoints else None
    return None


def _is_local_host(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    local = {"127.0.0.1", "::1", "0.0.0.0", "::"}
    with contextlib.suppress(OSError):
        local |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    return any(info[4][0] in local or info[4][0].startswith("127.") for info in infos)


def _listening_inodes(port: int, proc: Path) -> set[str]:
    """Inodes of TCP sockets listening on `port` (state 0A in /proc/net/tcp*)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... inode
            if len(fields) < 10 or fields[3] != "0A":
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes
