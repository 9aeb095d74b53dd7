"""`npu-spec bench --concurrency 1,2,4,8`: many users at once, side by side.

For each level N, bursts of N streaming greedy `/completion` requests sent at the same
moment, first to llama-server alone and then to `npu-spec serve` (managed, as users
run it), both with the same slots: the proxy's managed layout for k and the largest N
(k+1 slots for one speculative conversation plus N-1 pass-through slots), and
llama-server alone with that `-np`. One system runs at a time (the machine's cores
are not shared between them).

Per system and level: aggregate tokens per second (all tokens of a burst over the
burst's wall time, averaged over repeats), first-token wait (TTFT) p50 and p95 over
every stream, each stream's own tokens per second after its first token, and how many
streamed answers equal llama-server alone's solo greedy answer to the same prompt.
The proxy's columns also report how often speculation yielded and resumed
(`/metrics`). Drafters: the real drafter folder (`proxy` mode) and/or the oracle
(`oracle` mode: the target's own solo outputs, corrupted to `--oracle-acceptance`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from npu_draft.oracle import OracleConfig, write_oracle_folder
from proxy.bench.client import stream_events
from proxy.server.llama_server import LlamaServerProcess, free_port

log = logging.getLogger(__name__)

# Short, different openings: each stream of a burst gets its own prompt.
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when to use one.",
    "List ten ideas for a weekend trip in the mountains, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
    "Write a Python function that merges two sorted lists, and explain it.",
    "Summarise the causes of the French Revolution in a few paragraphs.",
    "Give a recipe for a vegetable soup and tips to make it better.",
    "Compare trains and planes for travelling across Europe.",
    "Write a polite email asking a colleague to review a pull request.",
    "What are the main ideas of stoic philosophy?",
    "Plan a one-week beginner running schedule.",
    "Explain the difference between TCP and UDP with examples.",
]


@dataclass
class ConcurrencyOptions:
    target: Path
    llama_server: Path
    levels: list[int]
    k: int = 4
    n_predict: int = 128
    repeats: int = 2
    ctx: int = 2048
    threads: int | None = None
    server_args: list[str] = field(default_factory=list)
    drafter: Path | None = None  # the real drafter (`proxy` mode)
    modes: list[str] = field(default_factory=lambda: ["plain", "proxy"])
    proxy_variants: list[tuple[str, list[str]]] = field(default_factory=lambda: [("", [])])
    oracle_acceptance: float = 0.8
    oracle_delay_ms: float = 0.0
    oracle_seed: int = 0
    provider: str = "auto"
    work_dir: Path = Path(".")
    startup_timeout: float = 600.0
    warmup_requests: int = 3  # single requests before the measured bursts

    @property
    def slots(self) -> int:
        return self.k + 1 + max(max(self.levels) - 1, 0)


@dataclass
class StreamResult:
    prompt: int
    ttft_s: float | None = None
    end_s: float = 0.0
    tokens: int = 0
    text: str = ""
    header: str = ""
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        if self.ttft_s is None or self.tokens < 2 or self.end_s <= self.ttft_s:
            return None
        return (self.tokens - 1) / (self.end_s - self.ttft_s)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n_predict: int, started: float
) -> StreamResult:
    """One streamed greedy /completion; times from `started` (the burst's start)."""
    result = StreamResult(prompt=0)
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "stream": True}
    for attempt in (1, 2):
        try:
            return await _stream_into(session, url, body, started, result)
        except aiohttp.ServerDisconnectedError as exc:
            # closed before any answer: a pooled keep-alive connection the server had
            # just dropped; nothing was received, so once more
            if attempt == 2 or result.ttft_s is not None:
                result.error = repr(exc)
    result.end_s = time.perf_counter() - started
    return result


async def _stream_into(
    session: aiohttp.ClientSession, url: str, body: dict, started: float, result: StreamResult
) -> StreamResult:
    try:
        async with session.post(url + "/completion", json=body) as response:
            result.header = response.headers.get("X-Npu-Spec", "")
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            chunks, predicted = 0, None
            async for event in stream_events(response.content):
                if "error" in event:
                    result.error = str(event["error"])
                    continue
                if event.get("content"):
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - started
                    result.text += event["content"]
                    chunks += 1
                if event.get("stop"):
                    predicted = (event.get("timings") or {}).get("predicted_n")
            result.tokens = int(predicted) if predicted else chunks
    except aiohttp.ServerDisconnectedError:
        if result.ttft_s is None:
            raise  # nothing came: the caller tries once more
        result.error = "server disconnected mid-stream"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = repr(exc)
    result.end_s = time.perf_counter() - started
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(bursts: list[list[StreamResult]], solo: dict[int, str]) -> dict[str, Any]:
    """One system at one level: the table's numbers from its bursts."""
    streams = [s for burst in bursts for s in burst]
    ok = [s for s in streams if s.error is None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    rates = [r for s in ok if (r := s.tokens_per_s) is not None]
    aggregate = [
        sum(s.tokens for s in burst) / max(max(s.end_s for s in burst), 1e-9)
        for burst in bursts
        if burst
    ]
    return {
        "streams": len(streams),
        "errors": len(streams) - len(ok),
        "aggregate_tok_s": statistics.mean(aggregate) if aggregate else None,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "stream_tok_s_mean": statistics.mean(rates) if rates else None,
        "equal_to_solo": sum(1 for s in ok if solo.get(s.prompt) == s.text),
        "headers": sorted({s.header for s in ok}),
        "error_samples": sorted({s.error for s in streams if s.error is not None})[:3],
    }


async def run_level(
    url: str, prompts: list[list[int]], n: int, options: ConcurrencyOptions
) -> list[list[StreamResult]]:
    bursts = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=options.startup_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for repeat in range(options.repeats):
            chosen = [(repeat * n + i) % len(prompts) for i in range(n)]
            started = time.perf_counter()
            burst = await asyncio.gather(
                *(
                    stream_completion(session, url, prompts[p], options.n_predict, started)
                    for p in chosen
                )
            )
            for p, result in zip(chosen, burst, strict=True):
                result.prompt = p
            bursts.append(list(burst))
    return bursts


async def _tokenize(session: aiohttp.ClientSession, url: str, text: str) -> list[int]:
    async with session.post(url + "/tokenize", json={"content": text, "add_special": True}) as r:
        return (await r.json())["tokens"]


async def _solo(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n_predict: int
) -> tuple[str, list[int]]:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True}
    async with session.post(url + "/completion", json=body) as response:
        payload = await response.json()
    return payload["content"], payload["tokens"]


async def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                name, _, value = line.partition(" ")
                if name.startswith("npu_spec_") and "{" not in name:
                    with contextlib.suppress(ValueError):
                        out[name] = float(value)
    return out


class ServeProcess:
    """`npu-spec serve --target` (managed mode) as a child process."""

    def __init__(
        self, options: ConcurrencyOptions, drafter: Path, extra: list[str], log_path: Path
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            sys.executable, "-m", "proxy.cli", "serve",
            "--target", str(options.target), "--drafter", str(drafter),
            "--llama-server", str(options.llama_server), "--provider", options.provider,
            "-k", str(options.k), "--ctx", str(options.ctx),
            "--passthrough-slots", str(options.slots - options.k - 1),
            "--port", str(self.port),
            *(["--threads", str(options.threads)] if options.threads else []),
            *[f"--server-arg={a}" for a in options.server_args],
            *extra,
        ]  # fmt: skip
        self.timeout = options.startup_timeout
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> ServeProcess:
        from proxy.bench.modes import _env_with_this_checkout

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as sink:
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdout=sink, stderr=sink, stdin=asyncio.subprocess.DEVNULL,
                env=_env_with_this_checkout(),
            )  # fmt: skip
        deadline = time.monotonic() + self.timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    raise RuntimeError(f"npu-spec serve exited; log {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.url + "/health") as response:
                        if response.status == 200:
                            return self
                await asyncio.sleep(0.5)
        await self.__aexit__()
        raise RuntimeError(f"npu-spec serve not ready in {self.timeout:.0f} s; {self.log_path}")

    async def __aexit__(self, *exc: object) -> None:
        process, self.process = self.process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 60)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _measure(
    name: str, url: str, prompts: list[list[int]], options: ConcurrencyOptions,
    solo: dict[int, str], result: dict[str, Any], warm: bool,
) -> None:  # fmt: skip
    async with aiohttp.ClientSession() as session:
        if warm:  # the proxy's policies measure as a running proxy's have
            for i in range(options.warmup_requests):
                await _solo(session, url, prompts[-1 - i % 2], options.n_predict)
    for n in options.levels:
        before = await _metrics(url)
        bursts = await run_level(url, prompts, n, options)
        after = await _metrics(url)
        row = summarise(bursts, solo)
        row["proxy_metrics"] = {
            key: after.get(key, 0.0) - before.get(key, 0.0)
            for key in ("npu_spec_speculation_yields_total", "npu_spec_speculation_resumes_total",
                        "npu_spec_rounds_total", "npu_spec_plain_run_tokens_total")
            if key in after
        }  # fmt: skip
        result["rows"].append({"system": name, "n": n, **row})
        log.info("%s N=%d: %s", name, n, {k: v for k, v in row.items() if k != "headers"})


async def run_concurrency(options: ConcurrencyOptions) -> dict[str, Any]:
    result: dict[str, Any] = {
        "kind": "concurrency",
        "options": {
            "levels": options.levels, "k": options.k, "n_predict": options.n_predict,
            "repeats": options.repeats, "slots": options.slots, "ctx": options.ctx,
            "threads": options.threads, "server_args": options.server_args,
            "modes": options.modes, "target": str(options.target),
            "drafter": str(options.drafter) if options.drafter else None,
            "oracle_acceptance": options.oracle_acceptance,
            "oracle_delay_ms": options.oracle_delay_ms,
        },
        "rows": [],
    }  # fmt: skip
    work = options.work_dir
    alone_args = ["-np", str(options.slots), "-c", str(options.slots * options.ctx), "--metrics"]
    alone_args += (["-t", str(options.threads)] if options.threads else []) + options.server_args
    server = LlamaServerProcess(
        options.llama_server, options.target, alone_args, log_path=work / "alone.log"
    )
    await server.start(options.startup_timeout)
    try:
        async with aiohttp.ClientSession() as session:
            prompts = [await _tokenize(session, server.base_url, p) for p in PROMPTS]
            solos = [await _solo(session, server.base_url, p, options.n_predict) for p in prompts]
        solo = {i: text for i, (text, _) in enumerate(solos)}
        if "plain" in options.modes:
            await _measure("llama-server", server.base_url, prompts, options, solo, result, False)
    finally:
        await server.stop()
    drafters: list[tuple[str, Path]] = []
    if "proxy" in options.modes and options.drafter is not None:
        drafters.append(("proxy", options.drafter))
    if "oracle" in options.modes:
        config = OracleConfig(
            acceptance=options.oracle_acceptance,
            delay_ms=options.oracle_delay_ms,
            seed=options.oracle_seed,
        )
        references = [(p, tokens) for p, (_, tokens) in zip(prompts, solos, strict=True)]
        folder = write_oracle_folder(work / "oracle", references, config)
        drafters.append((f"oracle(a={options.oracle_acceptance:g})", folder))
    for label, drafter in drafters:
        for variant, extra in options.proxy_variants:
            name = f"{label}[{variant}]" if variant else label
            log_path = work / f"serve-{label.split('(')[0]}-{variant or 'defaults'}.log"
            async with ServeProcess(options, drafter, extra, log_path) as serve:
                await _measure(name, serve.url, prompts, options, solo, result, True)
    return result


def render(result: dict[str, Any]) -> str:
    """The side-by-side table: each system's numbers and its ratio to llama-server alone."""
    rows = result["rows"]
    alone = {r["n"]: r for r in rows if r["system"] == "llama-server"}
    lines = [
        f"slots {result['options']['slots']} (both), k {result['options']['k']}, "
        f"{result['options']['n_predict']} tokens per stream, "
        f"{result['options']['repeats']} bursts per level",
        "| system | N | aggregate tok/s | vs alone | TTFT p50 s | TTFT p95 s | p95 vs alone "
        "| stream tok/s | equal to solo | errors | yields/resumes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in rows:
        base = alone.get(r["n"])
        agg_ratio = ttft_ratio = None
        if base is not None and r is not base:
            if base["aggregate_tok_s"] and r["aggregate_tok_s"]:
                agg_ratio = r["aggregate_tok_s"] / base["aggregate_tok_s"]
            if base["ttft_p95_s"] and r["ttft_p95_s"]:
                ttft_ratio = r["ttft_p95_s"] / base["ttft_p95_s"]
        metrics = r.get("proxy_metrics") or {}
        yields = (
            f"{metrics.get('npu_spec_speculation_yields_total', 0):g}/"
            f"{metrics.get('npu_spec_speculation_resumes_total', 0):g}"
            if metrics
            else "-"
        )
        lines.append(
            f"| {r['system']} | {r['n']} | {f(r['aggregate_tok_s'])} | {f(agg_ratio)}x "
            f"| {f(r['ttft_p50_s'])} | {f(r['ttft_p95_s'])} | {f(ttft_ratio)}x "
            f"| {f(r['stream_tok_s_mean'])} | {r['equal_to_solo']}/{r['streams']} "
            f"| {r['errors']} | {yields} |"
        )
    return "\n".join(lines)
