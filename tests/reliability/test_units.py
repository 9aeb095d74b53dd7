"""Fast checks of the fault machinery with fakes: managed-mode restarts, drafter
supervision, cut pass-through answers, the table renderer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy import native_memory, serve_cmd
from proxy.api import ProxyState, create_app
from proxy.config import ProxySettings
from proxy.drafter_guard import DrafterSupervisor
from proxy.engine import EngineSettings
from proxy.engine.drafting import DrafterBase
from proxy.engine.proposer import Proposer
from proxy.metrics import ProxyMetrics
from proxy.serve_cmd import redact_url
from proxy.server.llama_server import free_port
from proxy.server.managed import ServerSupervisor
from proxy.server.upstream import UpstreamClient
from proxy.slot_share import SlotShare
from tests.proxy.helpers import proxy_settings
from tests.reliability.tools import REPO, sse_events

# -- managed mode: restarting a dead llama-server ------------------------------------------


class FakeServer:
    base_url = "http://127.0.0.1:1"

    def __init__(self, fail_starts: int = 0) -> None:
        self.running = True
        self.starts = 0
        self.fail_starts = fail_starts

    async def stop(self) -> None:
        self.running = False

    async def start(self, timeout: float = 0) -> None:
        self.starts += 1
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise RuntimeError("model file vanished")
        self.running = True


async def test_supervisor_restarts_a_dead_server_then_gives_up():
    server = FakeServer()
    supervisor = ServerSupervisor(server, max_restarts=2, poll_s=0.01)  # type: ignore[arg-type]
    supervisor.start()
    try:
        for expected in (1, 2):
            server.running = False  # "killed"
            async with asyncio.timeout(5):
                while supervisor.restarts < expected:
                    await asyncio.sleep(0.01)
        server.running = False  # a third death within the window: give up, say so
        async with asyncio.timeout(5):
            while not supervisor.gave_up:
                await asyncio.sleep(0.01)
        assert supervisor.restarts == 2 and not server.running
    finally:
        await supervisor.stop()


async def test_supervisor_retries_a_failed_restart():
    server = FakeServer(fail_starts=1)
    supervisor = ServerSupervisor(server, max_restarts=3, poll_s=0.01)  # type: ignore[arg-type]
    supervisor.start()
    try:
        server.running = False
        async with asyncio.timeout(5):
            while supervisor.restarts < 1:
                await asyncio.sleep(0.01)
        assert server.starts == 2 and server.running
    finally:
        await supervisor.stop()


# -- drafter supervision ----------------------------------------------------------------


class Session(DrafterBase):
    def __init__(self, fail: bool = False, hang: bool = False) -> None:
        self.fail, self.hang, self.closed = fail, hang, False

    async def propose(self, committed, k):
        if self.hang:
            await asyncio.sleep(60)
        if self.fail:
            raise RuntimeError("NPU lost")
        return [1] * k

    async def close(self):
        self.closed = True


def _proposer(drafter: DrafterBase, supervisor: DrafterSupervisor) -> Proposer:
    """A generation's proposer for a session of `supervisor` (which it closes)."""
    return Proposer(drafter, EngineSettings().policies().for_request(None), guard=supervisor)


async def test_drafter_supervisor_recreates_after_a_failure():
    sessions: list[Session] = []
    reloads: list[int] = []

    def opener() -> Session:
        sessions.append(Session(fail=len(sessions) == 0))
        return sessions[-1]

    def reload():
        reloads.append(1)
        return opener

    supervisor = DrafterSupervisor(opener, reload, propose_timeout_s=1.0, n_vocab=10)
    first = await supervisor.open()
    assert first is not None and supervisor.sessions_open == 1
    with pytest.raises(RuntimeError):
        await supervisor.bounded(first.propose([1, 2], 3), 3, list)
    proposer = _proposer(first, supervisor)
    await proposer.close()
    await proposer.close()  # closing twice counts once
    assert supervisor.sessions_open == 0 and supervisor.failures == 1
    second = await supervisor.open()  # a fresh session on the same model
    assert second is not None and reloads == [] and supervisor.recreations == 1
    assert await supervisor.bounded(second.propose([1], 2), 2, list) == [1, 1]
    await _proposer(second, supervisor).close()
    assert all(s.closed for s in sessions)


async def test_the_drafter_model_reloads_after_a_second_failure_in_a_row_or_a_failed_open():
    opened: list[Session] = []
    reloads: list[int] = []
    fail_next = [True, True, False, True, False, False]  # the sessions' fates, in order

    def opener() -> Session:
        opened.append(Session(fail=fail_next[len(opened)]))
        return opened[-1]

    def reload():
        reloads.append(1)
        return opener

    supervisor = DrafterSupervisor(opener, reload, propose_timeout_s=1.0, n_vocab=10)

    async def use_once() -> None:
        session = await supervisor.open()
        assert session is not None
        with contextlib.suppress(RuntimeError):
            await supervisor.bounded(session.propose([1], 2), 2, list)
        await _proposer(session, supervisor).close()

    await use_once()  # fails: strike one
    await use_once()  # a fresh session on the same model fails again: strike two
    assert reloads == [] and supervisor.recreations == 1
    await use_once()  # reloaded first, then a good proposal clears the strikes
    assert reloads == [1] and supervisor.snapshot()["reloads"] == 1
    await use_once()  # fails once after a good proposal: a fresh session only
    await use_once()
    assert reloads == [1] and supervisor.recreations == 3
    supervisor.report_failure("open: broken", model_suspect=True)
    await use_once()  # a failed open reloads at once
    assert reloads == [1, 1] and supervisor.recreations == 4


class _FakeDraftSession:
    """A draft session that, like the real ones, refers to its model."""

    def __init__(self, model: _FakeDraftModel) -> None:
        self.model, self.tokens = model, []

    def sync(self, tokens):
        self.tokens = list(tokens)

    def propose(self, k, *args):
        return SimpleNamespace(tokens=[1] * k)

    def close(self) -> None:
        self.model = None


class _FakeDraftModel:
    info = SimpleNamespace(name="fake", backend="onnx", provider="cpu")

    def __init__(self) -> None:
        self.closed = False

    def open_session(self) -> _FakeDraftSession:
        return _FakeDraftSession(self)

    def close(self) -> None:
        self.closed = True


async def test_a_replaced_drafter_model_is_freed_and_the_current_one_closed(monkeypatch):
    """Issue 30: serve's reload must leave nothing holding the model it replaced (the
    opener kept in ProxyState held the first one for good: +1 model of RSS)."""
    import npu_draft.load

    loaded_models: list[weakref.ref[_FakeDraftModel]] = []

    def load_drafter(*args, **kwargs) -> _FakeDraftModel:
        model = _FakeDraftModel()
        loaded_models.append(weakref.ref(model))
        return model

    monkeypatch.setattr(npu_draft.load, "load_drafter", load_drafter)
    settings = ProxySettings(upstream="http://127.0.0.1:1", drafter="/drafter")
    # what serve keeps for its whole run: the opener (ProxyState) and the drafter (_Running)
    open_drafter, loaded = await serve_cmd._load_drafter(settings, None)
    assert open_drafter is not None and loaded is not None
    reload = serve_cmd._drafter_reloader(loaded)
    supervisor = DrafterSupervisor(open_drafter, reload)
    in_flight = await supervisor.open()  # a request still drafting on the first model
    assert in_flight is not None
    supervisor.report_failure("test", model_suspect=True)
    fresh = await supervisor.open()  # re-created: the model is loaded again
    assert fresh is not None and supervisor.recreations == 1 and len(loaded_models) == 2
    gc.collect()
    assert loaded_models[0]() is not None, "the in-flight session still drafts on it"
    await in_flight.close()
    supervisor.session_closed()
    del in_flight
    gc.collect()
    assert loaded_models[0]() is None, "the replaced model is still referenced"
    second = loaded_models[1]()
    assert second is not None and loaded.model is second
    await fresh.close()
    supervisor.session_closed()
    loaded.close()  # what serve does on the way out
    assert second.closed and supervisor.sessions_open == 0


async def test_drafter_supervisor_bounds_time_and_checks_ids():
    supervisor = DrafterSupervisor(lambda: Session(hang=True), propose_timeout_s=0.05)
    session = await supervisor.open()
    assert session is not None
    with pytest.raises(Exception, match="took over"):
        await supervisor.bounded(session.propose([1], 2), 2, list)
    await _proposer(session, supervisor).close()

    class Garbage(Session):
        async def propose(self, committed, k):
            return [5, 99]

    supervisor = DrafterSupervisor(Garbage, n_vocab=10)
    session = await supervisor.open()
    assert session is not None
    with pytest.raises(Exception, match="outside"):
        await supervisor.bounded(session.propose([1], 2), 2, list)
    await _proposer(session, supervisor).close()
    assert supervisor.failures == 1 and supervisor.sessions_open == 0


async def test_drafter_that_cannot_open_means_plain_decoding():
    def broken():
        raise OSError("no NPU")

    supervisor = DrafterSupervisor(broken)
    assert await supervisor.open() is None
    assert supervisor.failures == 1 and supervisor.sessions_open == 0


# -- glibc's free arena memory handed back (proxy/native_memory.py) ---------------------


async def test_free_heap_is_trimmed_after_a_drafter_recreation_and_a_server_restart(monkeypatch):
    """The soak's RSS: buffers freed by a failed session, a reload or a dead server's
    requests stayed resident as glibc's free arena space until trimmed."""
    trims: list[str] = []
    monkeypatch.setattr(native_memory, "trim_soon", trims.append)
    supervisor = DrafterSupervisor(Session, lambda: Session)
    session = await supervisor.open()
    assert session is not None
    await _proposer(session, supervisor).close()
    assert trims == [], "a session that closes without a failure frees nothing large"
    supervisor.report_failure("test")
    session = await supervisor.open()  # a fresh session on the same model
    assert session is not None and trims == ["drafter re-created"]
    await _proposer(session, supervisor).close()
    supervisor.report_failure("test", model_suspect=True)
    session = await supervisor.open()  # the model reloaded
    assert session is not None and supervisor.reloads == 1 and len(trims) == 2
    await _proposer(session, supervisor).close()

    server = FakeServer()
    restarts = ServerSupervisor(server, poll_s=0.01)  # type: ignore[arg-type]
    restarts.start()
    try:
        server.running = False  # "killed"
        async with asyncio.timeout(5):
            while restarts.restarts < 1:
                await asyncio.sleep(0.01)
        assert trims[-1] == "llama-server restarted"
    finally:
        await restarts.stop()


def test_trim_soon_runs_off_the_callers_thread_and_one_at_a_time(monkeypatch):
    calls: list[str] = []
    release = threading.Event()

    def fake_malloc_trim(pad: int) -> int:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            release.wait(5)  # still trimming while more requests come
        return 1

    monkeypatch.setattr(native_memory, "_malloc_trim", lambda: fake_malloc_trim)
    trimmer = native_memory._Trimmer()
    for _ in range(3):
        trimmer.soon("test")  # returns at once: the trim runs on its own thread
    release.set()
    deadline = time.monotonic() + 5
    while trimmer._running and time.monotonic() < deadline:
        time.sleep(0.01)
    # the two requests during the first trim make one more trim after it, not two
    assert calls == ["npu-heap-trim", "npu-heap-trim"]

    monkeypatch.setattr(native_memory, "_malloc_trim", lambda: None)  # no glibc
    trimmer.soon("test")
    assert native_memory.trim() == 0.0 and not trimmer._running and len(calls) == 2


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_is_found_and_runs_on_glibc():
    assert native_memory._malloc_trim() is not None
    assert native_memory.trim() >= 0.0


def _fake_mallopt(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(native_memory, "_mallopt", lambda: lambda p, v: calls.append((p, v)) or 1)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return calls


def test_tune_malloc_pins_the_thresholds_and_caps_the_arenas(monkeypatch):
    """The soak's RSS: glibc's dynamic thresholds put a reloaded model's blocks in the
    arenas, where they fragmented (docs/RELIABILITY.md, "Handing freed native memory
    back")."""
    calls = _fake_mallopt(monkeypatch)
    done = native_memory.tune_malloc()
    assert done == {"M_MMAP_THRESHOLD": 4 << 20, "M_TRIM_THRESHOLD": 8 << 20, "M_ARENA_MAX": 2}
    assert calls == [(-3, 4 << 20), (-1, 8 << 20), (-8, 2)]  # malloc.h's numbers


@pytest.mark.parametrize(
    ("env", "left"),
    [
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {"M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"}),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"}),
        ({"MALLOC_ARENA_MAX": "8"}, {"M_ARENA_MAX"}),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, {"M_ARENA_MAX"}),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
            {"M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"},
        ),
    ],
)
def test_tune_malloc_leaves_what_the_operator_set(monkeypatch, env, left):
    calls = _fake_mallopt(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = native_memory.tune_malloc()
    assert set(done) == {"M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "M_ARENA_MAX"} - left
    assert len(calls) == len(done)


def test_tune_malloc_does_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(native_memory, "_malloc_trim", lambda: None)
    native_memory._mallopt.cache_clear()
    try:
        assert native_memory.tune_malloc() == {}
    finally:
        native_memory._mallopt.cache_clear()


async def test_serve_tunes_malloc_before_it_starts_anything(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(native_memory, "tune_malloc", lambda: order.append("tune") or {})

    async def fake_serve(settings, running, ready):
        order.append("serve")
        return 0

    monkeypatch.setattr(serve_cmd, "_serve", fake_serve)
    assert await serve_cmd.serve(proxy_settings("http://127.0.0.1:9", k=1)) == 0
    assert order == ["tune", "serve"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's")
def test_tune_malloc_takes_on_glibc():
    """In a process of its own: the settings stay for the process's life."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    code = "from proxy import native_memory; print(sorted(native_memory.tune_malloc()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[0] == "['M_ARENA_MAX', 'M_MMAP_THRESHOLD', 'M_TRIM_THRESHOLD']"


# -- pass-through answers cut off by the server ----------------------------------------------


async def _half_answer_server(content_type: str) -> tuple[asyncio.Server, str]:
    """An 'llama-server' that starts a chunked answer and dies half-way."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        chunk = b'data: {"content": "half"}\n\n'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type.encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


def _state(url: str) -> ProxyState:
    props = {"default_generation_settings": {"params": {}, "n_ctx": 512}}
    return ProxyState(
        upstream=UpstreamClient(url), settings=proxy_settings(url, k=1),
        scheduler=SlotShare(2, 2), metrics=ProxyMetrics(), props=props,
        open_drafter=None, settings_template={},
    )  # fmt: skip


@pytest.mark.parametrize("content_type", ["text/event-stream", "application/json"])
async def test_cut_pass_through_answer_never_looks_complete(content_type):
    server, url = await _half_answer_server(content_type)
    state = _state(url)
    try:
        async with TestClient(TestServer(create_app(state))) as client:
            response = await client.post("/completion", json={"prompt": "x", "stream": True})
            if content_type == "text/event-stream":
                events, done = sse_events(await response.read())
                assert events[0] == {"content": "half"} and "error" in events[-1] and not done
            else:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.read()
    finally:
        server.close()
        await state.upstream.close()


# -- small pieces ------------------------------------------------------------------------------


def test_redact_url():
    assert redact_url("http://u:secret@127.0.0.1:8080/x") == "http://u:***@127.0.0.1:8080/x"
    assert redact_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"


def test_reliability_table_renders_records(tmp_path):
    spec = importlib.util.spec_from_file_location("rt", REPO / "scripts" / "reliability_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rt"] = module
    spec.loader.exec_module(module)
    row = {"suite": "faults", "fault": "a|b", "cases": 3, "outcome": "ok", "test": "t",
           "command": "pytest t", "recorded": "2026-01-01T00:00:00Z"}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(row))
    table = module.render(module.load_rows(tmp_path))
    assert "| faults | a\\|b | 3 | ok | `pytest t` |" in table and "3 cases" in table
    doc = f"intro\n{module.START}\nold\n{module.END}\ntail\n"
    assert (
        module.replace_table(doc, table) == f"intro\n{module.START}\n{table}\n{module.END}\ntail\n"
    )
    with pytest.raises(SystemExit):
        module.replace_table("no markers", table)


def test_new_settings_from_cli_env_and_file(tmp_path, monkeypatch):
    import argparse

    from proxy.serve_cmd import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = tmp_path / "npu-spec.toml"
    config.write_text('max-body-bytes = 2048\nupstream-api-key = "file-key"\n')
    monkeypatch.setenv("NPU_SPEC_MAX_QUEUE", "7")
    args = parser.parse_args(
        ["--upstream", "http://127.0.0.1:1", "--api-key", "k", "--no-slot-actions",
         "--draft-timeout", "2.5", "--config", str(config), "-k", "3"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings.api_key == "k" and settings.upstream_api_key == "file-key"
    assert settings.max_body_bytes == 2048 and settings.max_queue == 7
    assert settings.allow_slot_actions is False and settings.draft_timeout_s == 2.5
    assert settings.k == 3 and settings.restart_server is True  # older names unchanged
