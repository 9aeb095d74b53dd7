"""What the result JSON records about the machine and the server build."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from proxy.bench.procmem import gpu_names
from proxy.server.llama_server import server_version


def host_info(binary: Path) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "llama_server": str(binary),
        "llama_server_version": server_version(binary),
    }
