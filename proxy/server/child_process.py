"""A server binary run as a child process: its log, its start-up wait, its clean stop.

`LlamaServerProcess` (proxy.server.llama_server) and `RpcServerProcess` (proxy.server.rpc) differ
only in their command line and in what "ready" means.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

log = logging.getLogger(__name__)


class ChildProcess:
    """Started with `start()` (waits for `_wait_ready`), always stopped with `stop()`."""

    name = "child"  # for logs and errors

    def __init__(self, binary: Path, log_path: Path | None = None) -> None:
        self.binary = Path(binary)
        self.log_path = log_path
        self._process: asyncio.subprocess.Process | None = None
        self._log_file = None

    @property
    def command(self) -> list[str]:
        raise NotImplementedError

    async def _wait_ready(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    @property
    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.returncode

    async def start(self, timeout: float) -> None:
        if self.running:
            return
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        sink = self._log_file if self._log_file is not None else asyncio.subprocess.DEVNULL
        log.info("starting %s: %s", self.name, " ".join(self.command))
        self._process = await asyncio.create_subprocess_exec(
            *self.command, stdout=sink, stderr=sink, stdin=asyncio.subprocess.DEVNULL
        )
        try:
            await self._wait_ready(timeout)
        except BaseException:
            await self.stop()
            raise

    async def stop(self, grace: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
