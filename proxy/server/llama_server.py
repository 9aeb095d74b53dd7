"""Finding and running a stock llama-server binary.

The binary is looked up in this order: an explicit path (option or config), the
`LLAMA_SERVER` environment variable, `llama-server` on PATH, and finally the build
cache written by `npu-spec install-server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from proxy.server import server_install
from proxy.server.child_process import ChildProcess

log = logging.getLogger(__name__)


class LlamaServerNotFound(RuntimeError):
    pass


class LlamaServerStartError(RuntimeError):
    pass


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Return the llama-server binary to run, or raise with instructions."""
    tried: list[str] = []
    candidates: list[tuple[str, str | None]] = [
        ("explicit option", str(explicit) if explicit else None),
        ("LLAMA_SERVER", os.environ.get("LLAMA_SERVER")),
        ("PATH", shutil.which("llama-server")),
        ("npu-spec build cache", str(server_install.cached_binary_path())),
    ]
    for source, value in candidates:
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            log.debug("llama-server from %s: %s", source, path)
            return path
        tried.append(f"{source}: {path}")
        if source in ("explicit option", "LLAMA_SERVER"):
            # A path the user named must exist; falling back would hide their mistake.
            raise LlamaServerNotFound(
                f"llama-server not found at {path} (given by {source}); "
                "fix the path or run `npu-spec install-server`"
            )
    raise LlamaServerNotFound(
        "no llama-server binary found (looked at: "
        + ("; ".join(tried) or "LLAMA_SERVER unset, none on PATH, build cache empty")
        + "). Run `npu-spec install-server` to build the pinned stock llama-server, "
        "or set LLAMA_SERVER=/path/to/llama-server."
    )


def server_version(binary: Path) -> str:
    """The `--version` line of a llama-server binary (e.g. 'version: 11434 (abc123)')."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    lines = (result.stdout + result.stderr).splitlines()
    return next((line.strip() for line in lines if line.startswith("version")), "unknown")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LlamaServerProcess(ChildProcess):
    """One llama-server child process: started, health-checked, and always stopped."""

    name = "llama-server"

    def __init__(
        self,
        binary: Path,
        model: Path,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(binary, log_path)
        self.model = Path(model)
        self.extra_args = list(extra_args)
        self.host = host
        self.port = port or free_port(host)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    async def start(self, timeout: float = 180.0) -> None:
        await super().start(timeout)

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"{self.base_url}/health"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if not self.running:
                    raise LlamaServerStartError(
                        f"llama-server exited with code {self.exit_code} during "
                        f"start-up ({self._log_hint()}); command: {' '.join(self.command)}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise LlamaServerStartError(
            f"llama-server did not become healthy within {timeout:.0f} s ({self._log_hint()})"
        )

    def _log_hint(self) -> str:
        if self.log_path is None:
            return "pass log_path to keep its log"
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return f"log {self.log_path}:\n" + "\n".join(tail)

    async def __aenter__(self) -> LlamaServerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
