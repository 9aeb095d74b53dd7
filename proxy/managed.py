"""Managed mode: start llama-server with the flags verification needs (DESIGN.md §2)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from proxy.llama_server import LlamaServerProcess, find_llama_server


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
