"""Fixtures for the proxy tests: a reference llama-server (plain, one slot), a
speculative llama-server started with the managed-mode flags, and in-process
proxies in front of it with a chosen drafter.

Both servers use one thread each (CI has two cores) and the same per-slot context,
so "what llama-server alone writes" and what the proxy writes are comparable,
including where the context runs out.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.api import ProxyState, build_state, create_app
from proxy.engine import AsyncDrafter, AsyncSessionDrafter
from proxy.server.llama_server import LlamaServerProcess, free_port
from proxy.server.managed import ServerLayout, managed_server
from proxy.server.upstream import UpstreamClient
from tests.proxy.helpers import split_options

CTX = 768  # tokens per slot on both servers (a multiple of 256: llama.cpp pads -c)
SPEC_LAYOUT = ServerLayout(k=2, ctx_per_conversation=CTX, conversations=4, passthrough_slots=1)
LOG_DIR = Path(__file__).resolve().parents[2] / ".cache" / "test-logs"


@pytest_asyncio.fixture(scope="session")
async def ref_server(llama_server_bin: Path, demo_models: Path) -> AsyncIterator[str]:
    """llama-server alone: the output the proxy must reproduce."""
    server = LlamaServerProcess(
        llama_server_bin,
        demo_models / "target.gguf",
        ["-t", "1", "-c", str(CTX), "-np", "1"],
        log_path=LOG_DIR / "proxy-ref-server.log",
    )
    await server.start()
    try:
        yield server.base_url
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="session")
async def spec_server(
    llama_server_bin: Path, demo_models: Path, tmp_path_factory
) -> AsyncIterator[str]:
    """llama-server started exactly as managed mode starts it (13 slots)."""
    server = managed_server(
        demo_models / "target.gguf",
        SPEC_LAYOUT,
        binary=llama_server_bin,
        threads=1,
        slot_save_dir=tmp_path_factory.mktemp("slots"),
        log_path=LOG_DIR / "proxy-spec-server.log",
    )
    await server.start()
    try:
        yield server.base_url
    finally:
        await server.stop()


DrafterFactory = Callable[[], AsyncDrafter]


@pytest.fixture(scope="session")
def reference_drafter(demo_models: Path) -> DrafterFactory:
    """Exact numpy drafter over the `same` draft: every draft token is accepted."""
    from tests.support.reference import ReferenceDraftModel

    model = ReferenceDraftModel.from_hf(demo_models / "draft-hf", max_context=CTX + 16)
    return lambda: AsyncSessionDrafter(model.open_session())


@pytest.fixture(scope="session")
def drafter_for(demo_models: Path, make_models_dir) -> Callable[[str], DrafterFactory]:
    """Drafter factories by name: reference[:same|noisy|unrelated], ngram, onnx."""
    cache: dict[str, DrafterFactory] = {}

    def get(name: str) -> DrafterFactory:
        if name in cache:
            return cache[name]
        kind, _, draft = name.partition(":")
        if kind == "reference":
            from tests.support.reference import ReferenceDraftModel

            folder = make_models_dir(draft) if draft and draft != "same" else demo_models
            model = ReferenceDraftModel.from_hf(folder / "draft-hf", max_context=CTX + 16)
        elif kind == "ngram":
            from npu_draft.load import load_drafter

            model = load_drafter("ngram")
        else:
            from npu_draft.load import load_drafter

            if kind == "genai":
                pytest.importorskip("onnxruntime_genai", reason="genai backend not installed")
            folder = demo_models / "draft"
            if not folder.is_dir():
                pytest.fail(f"no exported drafter folder at {folder}")
            model = load_drafter(folder, "cpu", backend=kind, max_context=CTX + 16)
        cache[name] = lambda: AsyncSessionDrafter(model.open_session())
        return cache[name]

    return get


@dataclass
class RunningProxy:
    url: str
    state: ProxyState
    session: aiohttp.ClientSession

    async def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        async with self.session.post(self.url + path, json=body) as response:
            return response.status, await response.json(), dict(response.headers)


@contextlib.asynccontextmanager
async def run_proxy(
    upstream_url: str,
    drafter: DrafterFactory | None,
    k: int,
    check_decodes: bool = False,
    **options,
) -> AsyncIterator[RunningProxy]:
    """A proxy in front of `upstream_url`; `options` override single settings
    (`plain_runs="off"`) or give what serve() would start (`scheduler=...`)."""
    settings, started = split_options(upstream_url, k, check_decodes=check_decodes, **options)
    upstream = UpstreamClient(upstream_url, backend_sampling=settings.backend_sampling)
    state = await build_state(settings, upstream, drafter, **started)
    runner = web.AppRunner(create_app(state), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield RunningProxy(f"http://127.0.0.1:{port}", state, session)
    finally:
        await runner.cleanup()
        await upstream.close()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
