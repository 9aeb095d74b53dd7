"""Shared fixtures: the pinned llama-server binary, factory models, server processes.

Models are made by the offline factory and cached under `.cache/test-models/` in the
checkout, keyed by the factory's own source code and arguments, so a change to the
factory never reuses stale files.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from npu_draft.factory import make_models
from proxy.server.llama_server import LlamaServerProcess, find_llama_server

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / ".cache" / "test-models"
LOG_DIR = REPO / ".cache" / "test-logs"
STALE_MODELS_S = 6 * 3600  # another factory's model set unused this long is dropped
# Threads per test llama-server: CI has two cores shared by server and tests.
SERVER_THREADS = os.environ.get("NPU_SPEC_TEST_THREADS", "2")


def _factory_fingerprint() -> str:
    digest = hashlib.sha256()
    for folder in ("npu_draft/factory", "npu_draft/export.py", "tests/support/reference.py"):
        path = REPO / folder
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        for file in files:
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def cached_models(
    draft: str = "same", target_shape: str = "small", seed: int = 0, eos_boost: float = 0.0
) -> Path:
    """Factory output for these arguments, made once and reused."""
    eos = f"-eos{eos_boost:g}" if eos_boost else ""
    key = f"{target_shape}-{draft.replace(':', '_')}-s{seed}{eos}-{_factory_fingerprint()}"
    out = MODEL_CACHE / key
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    # Several pytest processes may want the same models: one makes them, the rest wait.
    with open(MODEL_CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            _make_cached(out, draft, target_shape, seed, eos_boost)
        else:
            os.utime(out)  # in use: another checkout's cleanup leaves it alone
    return out


def _make_cached(out: Path, draft: str, target_shape: str, seed: int, eos_boost: float) -> None:
    # Sets made by another factory (~1.3 GB each) are dropped once unused for a while;
    # one in use by another checkout sharing this cache (a worktree) is kept
    fingerprint = _factory_fingerprint()
    for stale in MODEL_CACHE.iterdir():
        if (
            stale.is_dir()
            and not stale.name.removesuffix(".partial").endswith(fingerprint)
            and time.time() - stale.stat().st_mtime > STALE_MODELS_S
        ):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    make_models(tmp, seed=seed, draft=draft, target_shape=target_shape, eos_boost=eos_boost)
    tmp.rename(out)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    # No skip: correctness claims need the real server, so its absence is a failure.
    return find_llama_server()


@pytest.fixture(scope="session")
def make_models_dir() -> Callable[..., Path]:
    return cached_models


@pytest.fixture(scope="session")
def demo_models() -> Path:
    return cached_models("same")


ServerFactory = Callable[..., Awaitable[LlamaServerProcess]]


@pytest_asyncio.fixture
async def start_server(llama_server_bin: Path, request) -> AsyncIterator[ServerFactory]:
    """Start llama-server processes for one test; all are stopped afterwards."""
    started: list[LlamaServerProcess] = []

    async def start(
        model: Path, extra_args: Sequence[str] = (), ctx: int = 2048
    ) -> LlamaServerProcess:
        args = ["-t", SERVER_THREADS, "-c", str(ctx), *extra_args]
        name = f"{request.node.name[:60]}-{len(started)}.log".replace("/", "_")
        server = LlamaServerProcess(llama_server_bin, model, args, log_path=LOG_DIR / name)
        started.append(server)
        await server.start()
        return server

    try:
        yield start
    finally:
        for server in started:
            await server.stop()
