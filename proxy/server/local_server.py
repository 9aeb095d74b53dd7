"""The command line of a llama-server on this machine, found by the port it listens on.

The HTTP API does not say whether the KV cache is unified (`-kvu`), and the batch split
a non-unified cache causes happens inside one llama_decode, where no counter sees it.
A server on this machine can still be asked the direct way: which process listens on
the port, and what flags did it start with (Linux /proc; None anywhere else).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})
_LISTEN = "0A"  # TCP state in /proc/net/tcp


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def listening_process(port: int, proc: Path = Path("/proc")) -> int | None:
    """The id of the process that listens on TCP `port`, if this user may see it."""
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port, proc)}
    if not sockets:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in sockets:
                        return int(entry.name)
    return None


def local_server_command(base_url: str) -> tuple[list[str], dict[str, str]] | None:
    """(argv, environment) of the process serving `base_url`, when it runs here."""
    parts = urlsplit(base_url)
    if parts.hostname not in LOOPBACK:
        return None
    pid = listening_process(parts.port or (443 if parts.scheme == "https" else 80))
    if pid is None:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    environ: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            name, _, value = item.decode(errors="replace").partition("=")
            environ[name] = value
    return [a.decode(errors="replace") for a in argv if a], environ


def kv_unified(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether llama-server runs with a unified KV cache, decided as b11434 decides it:
    the last -kvu / -no-kvu, else LLAMA_ARG_KV_UNIFIED, else on when -np is auto."""
    flags = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}
    chosen = [flags[arg] for arg in argv if arg in flags]
    if chosen:
        return chosen[-1]
    env = environ.get("LLAMA_ARG_KV_UNIFIED")
    if env is not None:
        return env in ("on", "enabled", "true", "1")
    parallel = environ.get("LLAMA_ARG_N_PARALLEL", "-1")
    for index, arg in enumerate(argv):
        if arg in ("-np", "--parallel") and index + 1 < len(argv):
            parallel = argv[index + 1]
        elif arg.startswith("--parallel="):
            parallel = arg.partition("=")[2]
    return parallel.strip() == "-1"  # "auto" slots turn the unified cache on
