"""Managed mode: start llama-server with the flags verification needs.

The flags and why each is needed: docs/ARCHITECTURE.md, "How one round works".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from proxy import native_memory
from proxy.server.llama_server import LlamaServerProcess, find_llama_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLayout:
    """Slot and context sizing for `conversations` speculative generations at once."""

    k: int
    ctx_per_conversation: int
    conversations: int = 1
    passthrough_slots: int = 1

    @property
    def slot_ctx(self) -> int:
        # llama-server pads -c to a multiple of 256; pad the per-slot cap the same way
        # so a conversation gets exactly the context `-c ctx` gives the server alone.
        return -(-self.ctx_per_conversation // 256) * 256

    @property
    def group_size(self) -> int:
        return self.k + 1

    @property
    def slots(self) -> int:
        return self.conversations * self.group_size + self.passthrough_slots

    @property
    def total_ctx(self) -> int:
        # Every slot may hold a whole conversation: k+1 copies per conversation, so
        # slots never get purged and the round's batch never splits.
        return self.slots * self.slot_ctx


def verification_flags(layout: ServerLayout, slot_save_dir: Path) -> list[str]:
    """llama-server arguments that make one verify round one llama_decode."""
    return [
        "-np", str(layout.slots),
        "-c", str(layout.total_ctx),
        "--kv-unified-per-slot", str(layout.slot_ctx),  # same limit as alone
        "-kvu",  # one batch across all slots, not one decode per sequence
        "--no-cache-idle-slots",  # idle-slot caching wipes the other slots on every task
        "-cram", "0",
        "--metrics",  # llamacpp:n_decode_total: the one-decode-per-round check
        "--slot-save-path", str(slot_save_dir),
    ]  # fmt: skip


def managed_server(
    model: Path,
    layout: ServerLayout,
    binary: Path | str | None = None,
    threads: int | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    slot_save_dir: Path | None = None,
    extra_args: list[str] | None = None,
    log_path: Path | None = None,
) -> LlamaServerProcess:
    """A LlamaServerProcess ready to `start()`; the caller must `stop()` it."""
    if not Path(model).is_file():
        raise FileNotFoundError(f"target model {model} does not exist")
    if slot_save_dir is None:
        slot_save_dir = Path(tempfile.mkdtemp(prefix="npu-spec-slots-"))
    slot_save_dir.mkdir(parents=True, exist_ok=True)  # llama-server refuses a missing dir
    args = verification_flags(layout, slot_save_dir)
    if threads is not None:
        args += ["-t", str(threads)]
    args += list(extra_args or [])
    return LlamaServerProcess(
        find_llama_server(binary), Path(model), args, host=host, port=port, log_path=log_path
    )


def write_key_file(key: str, folder: Path) -> Path:
    """The upstream key as a 0600 file for `--api-key-file`: a key on the command line
    would show in `ps` and in the proxy's own "starting llama-server" log line."""
    path = folder / "upstream-api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return path


class ServerSupervisor:
    """Managed mode: restart llama-server when it dies, on the same host and port, so
    the proxy's upstream URL stays valid. Streams that were running when it died end
    with an error event (the API's job); requests made while it restarts get 503 with
    Retry-After. At most `max_restarts` restarts per `window_s`, then it gives up and
    says so (a server that crashes at start-up would otherwise loop forever).
    """

    def __init__(
        self,
        server: LlamaServerProcess,
        max_restarts: int = 5,
        window_s: float = 600.0,
        poll_s: float = 0.2,
        start_timeout_s: float = 180.0,
    ) -> None:
        self.server = server
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.poll_s = poll_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.gave_up = False
        self._recent: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="llama-server supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if self.server.running:
                continue
            now = time.monotonic()
            self._recent = [t for t in self._recent if now - t < self.window_s]
            if len(self._recent) >= self.max_restarts:
                self.gave_up = True
                log.error(
                    "llama-server died %d times within %.0f s; not restarting it again",
                    len(self._recent) + 1, self.window_s,
                )  # fmt: skip
                return
            self._recent.append(now)
            log.error("llama-server at %s died; restarting it", self.server.base_url)
            try:
                await self.server.stop()  # reap the old process, close its log
                await self.server.start(self.start_timeout_s)
            except Exception as exc:  # the next poll retries
                log.error("restarting llama-server failed: %s", exc)
                continue
            self.restarts += 1
            log.info("llama-server restarted (%d so far)", self.restarts)
            # the requests its death cut off have ended and freed their buffers (and
            # their draft sessions'): hand glibc's free arena space back
            native_memory.trim_soon("llama-server restarted")
