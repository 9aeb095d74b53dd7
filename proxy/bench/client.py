"""One streamed greedy `/completion`, timed from the client's side.

Time to first token is when the first chunk carrying text or a token arrives.
Decode speed follows llama-server's own convention: (tokens - 1) / (last token -
first token), with the token count the server reports at the end.

Streamed token ids are NOT the output: llama-server b11434 leaves out the id of a
token whose text ends inside a UTF-8 character (its bytes come with the next
chunk), and the proxy copies that faithfully. Exact token lists come from a
non-streamed request (`exact_tokens`).
Counters are read from `/metrics` before the request, when the first token
arrives, and after the end, so round statistics can leave out the first round
(which also fills the prompt into the cache).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.server.upstream import parse_prometheus

SPEC_HEADER = "X-Npu-Spec"
PASSTHROUGH = "passthrough"  # the header's value for a request llama-server answered whole
FIRST_N_TOKENS = 32  # issue 29's "first-32-token time" of a cold request


@dataclass
class StreamedCompletion:
    tokens: list[int]  # the ids the stream carried (see the module note)
    text: str
    n_predicted: int  # tokens generated, as the final chunk reports (else len(tokens))
    ttft_ms: float
    # start -> the stream carried its FIRST_N_TOKENS-th token (None: fewer came); a cold
    # request's slot fill shows here, not in ttft_ms
    first_n_ms: float | None
    total_ms: float
    decode_ms: float  # first token -> last token
    timings: dict[str, Any]  # the final chunk's `timings`, as the server reports them
    spec_header: str | None  # the proxy's X-Npu-Spec answer header (None: plain server)
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_first: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        if self.n_predicted < 2 or self.decode_ms <= 0:
            return None
        return (self.n_predicted - 1) / (self.decode_ms / 1e3)

    @property
    def e2e_tokens_per_s(self) -> float | None:
        return self.n_predicted / (self.total_ms / 1e3) if self.total_ms > 0 else None


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url) as response:
        response.raise_for_status()
        return parse_prometheus(await response.text())


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Lines of any length (a final chunk can carry a whole long prompt's text)."""
    buffer = b""
    async for data in stream.iter_any():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def stream_events(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE stream, up to `data: [DONE]` where one is sent."""
    async for raw in _lines(stream):
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


async def _after_first_round(
    session: aiohttp.ClientSession, url: str, before: dict[str, float], counter: str | None
) -> dict[str, float]:
    values = await fetch_metrics(session, url)
    for _ in range(200):  # a round is counted right after its tokens go out
        if counter is None or values.get(counter, 0) > before.get(counter, 0):
            break
        await asyncio.sleep(0.001)
        values = await fetch_metrics(session, url)
    return values


def completion_body(
    prompt: list[int] | tuple[int, ...], n_predict: int, stream: bool = True
) -> dict[str, Any]:
    return {
        "prompt": list(prompt),
        "n_predict": n_predict,
        "temperature": 0.0,
        "cache_prompt": True,
        "stream": stream,
        "return_tokens": True,
    }


async def exact_tokens(
    session: aiohttp.ClientSession, base_url: str, prompt: list[int] | tuple[int, ...],
    n_predict: int,
) -> list[int]:  # fmt: skip
    """The generated token ids, complete (non-streamed request)."""
    body = completion_body(prompt, n_predict, stream=False)
    async with session.post(base_url + "/completion", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"/completion answered {response.status}: {await response.text()}")
        return [int(t) for t in (await response.json())["tokens"]]


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    prompt: list[int] | tuple[int, ...],
    n_predict: int,
    metrics_url: str | None = None,
    round_counter: str | None = None,
) -> StreamedCompletion:
    """With `metrics_url`, counters are read before, at the first token and after.
    With `round_counter` (a counter that grows once per round), the first-token
    reading waits until it shows the first round: a server may stream a round's
    tokens before it counts the round."""
    before = await fetch_metrics(session, metrics_url) if metrics_url else {}
    first_snapshot: asyncio.Task | None = None
    tokens: list[int] = []
    pieces: list[str] = []
    n_predicted: int | None = None
    timings: dict[str, Any] = {}
    first_at = last_at = first_n_at = None
    started = time.perf_counter()
    async with session.post(
        base_url + "/completion", json=completion_body(prompt, n_predict)
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"/completion answered {response.status}: {await response.text()}")
        header = response.headers.get(SPEC_HEADER)
        async for chunk in stream_events(response.content):
            new = [int(t) for t in chunk.get("tokens") or []]
            piece = chunk.get("content") or ""
            if new or piece:
                now = time.perf_counter()
                if first_at is None:
                    first_at = now
                    if metrics_url:
                        # a pass-through counts no round: waiting for one polled the
                        # proxy's /metrics (and the server's behind it) 200 times while
                        # the server decoded, and on 2 cores that held pass-through
                        # chats at 0.70-0.77x plain (docs/BENCHMARKS.md)
                        counter = None if header == PASSTHROUGH else round_counter
                        first_snapshot = asyncio.create_task(
                            _after_first_round(session, metrics_url, before, counter)
                        )
                last_at = now
                tokens += new
                pieces.append(piece)
                if first_n_at is None and len(tokens) >= FIRST_N_TOKENS:
                    first_n_at = now
            if chunk.get("timings"):
                timings = chunk["timings"]
            if chunk.get("stop") and "tokens_predicted" in chunk:
                n_predicted = int(chunk["tokens_predicted"])
    ended = time.perf_counter()
    first_metrics = await first_snapshot if first_snapshot is not None else {}
    after = await fetch_metrics(session, metrics_url) if metrics_url else {}
    first_at = first_at or ended
    last_at = last_at or ended
    return StreamedCompletion(
        tokens=tokens,
        text="".join(pieces),
        n_predicted=n_predicted if n_predicted is not None else len(tokens),
        ttft_ms=(first_at - started) * 1e3,
        first_n_ms=None if first_n_at is None else (first_n_at - started) * 1e3,
        total_ms=(ended - started) * 1e3,
        decode_ms=(last_at - first_at) * 1e3,
        timings=timings,
        spec_header=header,
        metrics_before=before,
        metrics_first=first_metrics,
        metrics_after=after,
    )
