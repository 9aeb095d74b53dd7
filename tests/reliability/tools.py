"""Fault-injection tools for the reliability suites: a loopback TCP relay that can
stall or cut a connection, raw HTTP clients that hang up at a chosen moment,
drafters that fail on purpose, and the recorder behind docs/RELIABILITY.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api import ProxyState, build_state, create_app
from proxy.engine.drafting import DrafterBase
from proxy.server.llama_server import free_port
from proxy.server.upstream import Timeouts, UpstreamClient
from tests.proxy.helpers import split_options

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("NPU_SPEC_RELIABILITY_RESULTS", REPO / ".cache" / "reliability"))


# -- the record behind docs/RELIABILITY.md -----------------------------------------


def record(
    nodeid: str, suite: str, fault: str, cases: int, outcome: str, command: str | None = None
) -> None:
    """One row of the reliability table, written only by a test that passed its
    assertions (a failing test leaves no row, and the renderer reports it missing)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    test_file, _, name = nodeid.partition("::")
    row = {
        "suite": suite,
        "fault": fault,
        "cases": cases,
        "outcome": outcome,
        "test": nodeid,
        "command": command or f"pytest '{nodeid}' -q",
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{test_file}-{name}-{fault}")
    (RESULTS / f"{safe[:180]}.json").write_text(json.dumps(row, indent=1) + "\n")


# -- a relay that stalls or cuts llama-server's connections --------------------------


class FaultRelay:
    """127.0.0.1 TCP relay in front of `target` (host, port).

    mode "pass": bytes flow; "stall": bytes from the server are held (the server
    looks alive but silent); "down": every open connection is cut and the port stops
    listening (connection refused), as when llama-server has died.
    """

    def __init__(self, target_url: str) -> None:
        host_port = target_url.split("://", 1)[1].rstrip("/")
        host, _, port = host_port.partition(":")
        self.target = (host, int(port))
        self.mode = "pass"
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FaultRelay:
        await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.set_mode("down")

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )

    async def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "stall":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "down":
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
        elif self._server is None:
            await self._listen()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, gated: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    if gated:
                        await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        finally:
            self._writers -= {writer, up_writer}


# -- raw clients that hang up ----------------------------------------------------------


async def hang_up(
    url: str, path: str, body: dict, after_bytes: int = 0, wait_s: float = 0.0
) -> bytes:
    """POST `body`, read until `after_bytes` of the answer arrived (0: none), then
    wait `wait_s` and drop the connection. Returns what was read."""
    host_port = url.split("://", 1)[1]
    host, _, port = host_port.partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    got = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            while len(got) < after_bytes:
                chunk = await reader.read(after_bytes - len(got))
                if not chunk:
                    break
                got += chunk
    await asyncio.sleep(wait_s)
    writer.transport.abort()
    return got


async def wait_until(predicate, timeout: float = 20.0, step: float = 0.05) -> bool:
    """Poll a (sync or async) predicate until true or `timeout` (bounded loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        await asyncio.sleep(step)
    return False


async def server_idle(base_url: str) -> bool:
    async with UpstreamClient(base_url) as upstream:
        return not any(slot["is_processing"] for slot in await upstream.slots())


# -- drafters that misbehave ------------------------------------------------------------


class FaultyDrafter(DrafterBase):
    """Wraps a real drafter; misbehaves on proposal number `at` (0-based) of every
    session: "raise", "hang", "garbage" (ids outside the vocabulary) or "slow"."""

    def __init__(self, inner, fault: str, at: int = 1, delay_s: float = 0.0) -> None:
        self.inner, self.fault, self.at, self.delay_s = inner, fault, at, delay_s
        self.calls = 0

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        call, self.calls = self.calls, self.calls + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if call == self.at:
            if self.fault == "raise":
                raise RuntimeError("injected drafter crash")
            if self.fault == "hang":
                await asyncio.sleep(3600)
            if self.fault == "garbage":
                return [10**9, -5][:k]
        return await self.inner.propose(committed, k)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class DrafterCounter:
    """A drafter factory that counts the sessions it opened."""

    factory: Any
    fault: str | None = None
    at: int = 1
    delay_s: float = 0.0
    fail_open: int = 0  # the next N opens raise
    opened: int = 0
    sessions: list[Any] = field(default_factory=list)

    def __call__(self):
        if self.fail_open > 0:
            self.fail_open -= 1
            raise RuntimeError("injected: drafter cannot open a session")
        self.opened += 1
        inner = self.factory()
        if self.fault is None and not self.delay_s:
            return inner
        return FaultyDrafter(inner, self.fault or "none", self.at, self.delay_s)


# -- an in-process proxy with the reliability knobs -----------------------------------------


@dataclass
class Proxy:
    url: str
    state: ProxyState
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kwargs) -> tuple[int, Any, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
        async with self.session.post(self.url + path, data=data, headers=headers, **kwargs) as r:
            raw = await r.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw
            return r.status, payload, dict(r.headers)

    async def metric(self, name: str) -> float:
        async with self.session.get(self.url + "/metrics") as response:
            page = await response.text()
        for line in page.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def idle(self) -> bool:
        state = self.state
        drafters = state.drafters.sessions_open if state.drafters is not None else 0
        return state.scheduler.idle() and drafters == 0


@contextlib.asynccontextmanager
async def proxy_for(
    upstream_url: str,
    drafter,
    k: int = 2,
    timeouts: Timeouts | None = None,
    upstream_api_key: str | None = None,
    **options: Any,
) -> AsyncIterator[Proxy]:
    upstream = UpstreamClient(upstream_url, timeouts, api_key=upstream_api_key)
    settings, started = split_options(upstream_url, k, **options)
    state = await build_state(settings, upstream, drafter, **started)
    runner = web.AppRunner(create_app(state), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield Proxy(f"http://127.0.0.1:{port}", state, session)
    finally:
        await runner.cleanup()
        await upstream.close()


def sse_events(raw: bytes) -> tuple[list[dict], bool]:
    """(events, ended with [DONE]) of an SSE body; tolerant of a cut last block."""
    events: list[dict] = []
    done = False
    for block in raw.decode("utf-8", "replace").split("\n\n"):
        block = block.strip()
        if not block.startswith("data: "):
            continue
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        with contextlib.suppress(ValueError):
            events.append(json.loads(data))
    return events, done


def is_openai_error(payload: Any, status: int) -> bool:
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return False
    error = payload["error"]
    return (
        error.get("code") == status
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )
