"""Peak memory of processes: RSS high-water mark from /proc, GPU memory via nvidia-smi."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process in MiB; None when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (all its threads' children)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(children))


def _nvidia_smi(query: str, units: bool = False) -> str | None:
    """nvidia-smi's CSV answer without header, or None where it cannot answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader" + ("" if units else ",nounits")],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_memory_mb() -> dict[int, float] | None:
    """{pid: MiB} for every process holding GPU memory; None without nvidia-smi."""
    out = _nvidia_smi("--query-compute-apps=pid,used_memory")
    if out is None:
        return None
    usage: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage


def gpu_used_mb() -> float | None:
    """Memory in use on all GPUs together (MiB): the fallback where nvidia-smi
    cannot see this container's process ids."""
    out = _nvidia_smi("--query-gpu=memory.used")
    try:
        return None if out is None else sum(float(line) for line in out.split())
    except ValueError:
        return None


def gpu_names() -> list[str]:
    out = _nvidia_smi("--query-gpu=name,memory.total,driver_version", units=True)
    return [] if out is None else [line.strip() for line in out.splitlines() if line.strip()]
