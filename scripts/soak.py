#!/usr/bin/env python3
"""Soak under faults (issue 30), bounded in time, loopback only.

`npu-spec serve` in managed mode (a child process: its RSS is the proxy's alone) with
the drafter of a `npu-spec make-models` folder wrapped so that a share of its draft
sessions fail (an exception, ids outside the vocabulary, or a hang past the draft
timeout); `--streams` clients send greedy requests without pause (non-streamed ones
whose token ids are checked, streamed ones whose text is checked, and streamed ones
the client abandons after the first chunk), in phases: a third of every `--phase-s`
one client alone (it speculates), the rest all of them; llama-server is killed (SIGKILL) every
`--kill-every-s` and managed mode must restart it. Counted:

- lost: a request with no answer within its timeout, or an answer that is neither
  complete nor an explicit error (target 0);
- garbled: a complete answer that does not parse, or a stream without its end;
- unexplained: a complete greedy answer that differs from llama-server alone's and is
  not a proven near-tie (`proxy.bench.neartie`, top-2 logit gap) (target 0);
- clean errors: explicit 5xx answers and stream error events, expected around a kill;
- the proxy's RSS growth from the first sample after warm-up to the end (< 5%).

    python scripts/soak.py --models .cache/test-models/small-same-s0-... \\
        --duration-s 600 --kill-every-s 150 --streams 8 -o soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP, top2_gap  # noqa: E402
from proxy.engine.drafting import DrafterBase  # noqa: E402
from proxy.server.llama_server import LlamaServerProcess, find_llama_server, free_port  # noqa: E402

PROMPTS = [
    "Once upon a time", "The weather today", "Write a list of fruits", "In the year 3000",
    "Dear customer,", "The recipe needs", "A poem about rain", "Rules of chess:",
    "Tell me about the sea", "The train left at", "My favourite book", "How to fix a bike",
]  # fmt: skip


# -- the child: npu-spec serve with a drafter that fails now and then ----------------------


class _FaultyDrafter(DrafterBase):
    def __init__(self, inner, fault: str, at: int) -> None:
        self.inner, self.fault, self.at, self.calls = inner, fault, at, 0

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        call, self.calls = self.calls, self.calls + 1
        if call == self.at:
            if self.fault == "raise":
                raise RuntimeError("soak: injected drafter crash")
            if self.fault == "garbage":
                return [10**9, -5][:k]
            if self.fault == "hang":
                await asyncio.sleep(3600)
        return await self.inner.propose(committed, k)

    async def close(self) -> None:
        await self.inner.close()


def _faulty(factory, rate: float, rng: random.Random):
    def open_session():
        inner = factory()
        if rng.random() >= rate:
            return inner
        return _FaultyDrafter(inner, rng.choice(["raise", "garbage", "hang"]), rng.randint(0, 4))

    return open_session


def child(config: dict) -> int:
    import logging

    from proxy import serve_cmd
    from proxy.config import ProxySettings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    rng = random.Random(config.pop("seed"))
    rate = config.pop("fault_rate")
    load, reloader = serve_cmd._load_drafter, serve_cmd._drafter_reloader

    async def load_faulty(settings, facts):
        factory, model = await load(settings, facts)
        return (_faulty(factory, rate, rng) if factory else None), model

    def reload_faulty(loaded):
        reload = reloader(loaded)
        return lambda: _faulty(reload(), rate, rng)

    serve_cmd._load_drafter, serve_cmd._drafter_reloader = load_faulty, reload_faulty
    return asyncio.run(serve_cmd.serve(ProxySettings(**config)))


# -- the parent: load, kills, accounting --------------------------------------------------------


def _median_within(
    series: list[tuple[float, float]], start_s: float, span_s: float, first: bool
) -> float | None:
    """The median RSS of the first (or last) `span_s` seconds of samples from `start_s`."""
    kept = [(t, v) for t, v in series if t >= start_s] or series
    if not kept:
        return None
    edge = kept[0][0] + span_s if first else kept[-1][0] - span_s
    values = sorted(v for t, v in kept if (t <= edge if first else t >= edge))
    return round(values[len(values) // 2], 1)


def _growth_pct(first: float | None, last: float | None) -> float | None:
    return round(100 * (last - first) / first, 2) if first and last else None


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident memory (VmRSS), or a part of it: RssAnon (its heap: what a
    leak grows) or RssFile (pages of mapped files, such as the drafter's weights, paged
    in as drafts touch more of the embedding; bounded by the files, reclaimable)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None


def llama_server_pid(parent: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"llama-server" in (entry / "cmdline").read_bytes():
                return int(entry.name)
    return None


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, refs: dict[int, dict]) -> None:
        self.args, self.url, self.refs = args, url, refs
        self.counts: Counter[str] = Counter()
        self.answers: list[tuple[int, list[int], str]] = []  # (prompt, tokens, text)
        self.texts: list[tuple[int, str]] = []  # (prompt, streamed text)
        self.stream_differences: list[dict] = []  # the first unexplained streamed texts
        self.rng = random.Random(args.seed)

    def busy(self) -> bool:
        """Load phases: of every `--phase-s`, the first third has one client only (it
        speculates, so drafter faults strike), the rest all of them (speculation
        yields to the newcomers, and resumes in the next quiet third)."""
        return (time.monotonic() % self.args.phase_s) >= self.args.phase_s / 3

    async def worker(
        self, session: aiohttp.ClientSession, deadline: float, number: int = 0
    ) -> None:
        while time.monotonic() < deadline:
            if number > 0 and not self.busy():
                await asyncio.sleep(0.5)
                continue
            prompt = self.rng.randrange(len(PROMPTS))
            roll = self.rng.random()
            kind = "abort" if roll < self.args.abort_rate else "stream" if roll < 0.45 else "json"
            self.counts[f"sent_{kind}"] += 1
            try:
                async with asyncio.timeout(self.args.request_timeout_s):
                    outcome = await getattr(self, kind)(session, prompt)
            except TimeoutError:
                outcome = "lost"
            except aiohttp.ClientError as exc:
                # the proxy itself never drops a connection without an answer
                outcome = "lost"
                print(f"lost: {kind}: {exc!r}", flush=True)
            self.counts[outcome] += 1
            if outcome == "clean_error":
                await asyncio.sleep(0.5)  # as a client honouring Retry-After would

    def _body(self, prompt: int, **extra) -> dict:
        return {"prompt": PROMPTS[prompt], "n_predict": self.args.n_predict, "temperature": 0,
                **extra}  # fmt: skip

    async def json(self, session: aiohttp.ClientSession, prompt: int) -> str:
        body = self._body(prompt, return_tokens=True)
        async with session.post(self.url + "/completion", json=body) as response:
            raw = await response.read()
            if response.status >= 500:
                payload = json.loads(raw)
                return "clean_error" if "error" in payload else "garbled"
            if response.status != 200:
                return "garbled"
            try:
                payload = json.loads(raw)
            except ValueError:
                return "garbled"
            self.answers.append((prompt, payload["tokens"], payload["content"]))
            return "complete"

    async def stream(self, session: aiohttp.ClientSession, prompt: int) -> str:
        body = self._body(prompt, stream=True)
        async with session.post(self.url + "/completion", json=body) as response:
            raw = await response.read()
            if response.status != 200:
                payload = json.loads(raw)
                return "clean_error" if "error" in payload else "garbled"
        text, ended, errored = "", False, False
        for block in raw.split(b"\n\n"):
            if not block.startswith(b"data: "):
                continue
            try:
                event = json.loads(block[6:])
            except ValueError:
                return "garbled"
            if "error" in event:
                errored = True
            text += event.get("content", "")
            ended = ended or bool(event.get("stop"))
        if errored and not ended:
            return "clean_error"
        if not ended or errored:
            return "garbled"
        self.texts.append((prompt, text))
        return "complete"

    async def abort(self, session: aiohttp.ClientSession, prompt: int) -> str:
        body = self._body(prompt, stream=True)
        async with session.post(self.url + "/completion", json=body) as response:
            if response.status != 200:
                await response.read()
                return "clean_error"
            await response.content.readany()
            response.close()  # the client hangs up after the first chunk
        return "aborted"

    async def killer(self, pid: int, deadline: float) -> None:
        while True:
            wait = min(self.args.kill_every_s, deadline - time.monotonic())
            if wait <= 5:
                return
            await asyncio.sleep(wait)
            server = llama_server_pid(pid)
            if server is not None:
                os.kill(server, signal.SIGKILL)
                self.counts["server_kills"] += 1
                print(f"{time.strftime('%H:%M:%S')} killed llama-server {server}", flush=True)


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url + "/metrics") as response:
            for line in (await response.text()).splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    return None


async def references(args, binary: Path, target: Path) -> tuple[LlamaServerProcess, dict]:
    ref = LlamaServerProcess(binary, target, ["-t", "1", "-c", "2048", "-np", "1"])
    await ref.start()
    refs = {}
    async with aiohttp.ClientSession() as session:
        for i, text in enumerate(PROMPTS):
            body = {"prompt": text, "n_predict": args.n_predict, "temperature": 0,
                    "return_tokens": True}  # fmt: skip
            async with session.post(ref.base_url + "/completion", json=body) as response:
                payload = await response.json()
            async with session.post(
                ref.base_url + "/tokenize", json={"content": text, "add_special": True}
            ) as response:
                prompt = (await response.json())["tokens"]
            refs[i] = {"tokens": payload["tokens"], "content": payload["content"], "prompt": prompt}
    return ref, refs


async def check(soak: Soak, ref_url: str) -> dict:
    """Each complete answer against llama-server alone; a difference is excused only at
    a proven near-tie."""
    out = Counter()
    verdicts: dict[tuple[int, str], str] = {}  # (prompt, text) -> verdict of its tokens
    async with aiohttp.ClientSession() as session:
        for prompt, tokens, text in soak.answers:
            expected = soak.refs[prompt]["tokens"]
            if tokens == expected:
                out["equal"] += 1
                continue
            if (prompt, text) not in verdicts:
                verdicts[prompt, text] = await _verdict(session, ref_url, soak.refs[prompt], tokens)
            out[verdicts[prompt, text]] += 1
        for prompt, text in soak.texts:
            # streamed answers: their text; one that differs is judged by its tokens (a
            # non-streamed answer's with the same text, else the text tokenized again)
            ref = soak.refs[prompt]
            if text == ref["content"]:
                out["stream_equal"] += 1
                continue
            if (prompt, text) not in verdicts:
                verdicts[prompt, text] = await _stream_verdict(session, ref_url, ref, text)
            verdict = verdicts[prompt, text]
            out["stream_near_tie" if verdict == "near_tie" else "stream_unexplained"] += 1
            if verdict != "near_tie" and len(soak.stream_differences) < 5:
                soak.stream_differences.append(
                    {"prompt": prompt, "text": text, "reference": ref["content"]}
                )
    return dict(out)


async def _verdict(
    session: aiohttp.ClientSession, ref_url: str, ref: dict, tokens: list[int]
) -> str:
    """near_tie where `tokens` first leave the reference at a proven near-tie (the
    server's top-2 hold both and their gap is under the margin); else unexplained (a
    strict prefix too: an answer cut short)."""
    expected = ref["tokens"]
    i = next((j for j, (a, b) in enumerate(zip(expected, tokens, strict=False)) if a != b), None)
    if i is None:
        return "unexplained"
    ids, gap = await top2_gap(session, ref_url, ref["prompt"] + expected[:i])
    return "near_tie" if tokens[i] in ids and gap < NEAR_TIE_LOGIT_GAP else "unexplained"


async def _stream_verdict(
    session: aiohttp.ClientSession, ref_url: str, ref: dict, text: str
) -> str:
    """near_tie where a streamed text leaves the reference at a proven near-tie: the
    first reference token whose text is not in `text` (pieces cut inside a UTF-8
    character are compared without the cut) is where the server's top-2 gap is under
    the margin, and `text` goes on with the runner-up's text there."""
    expected = ref["tokens"]

    async def follows(ids: list[int]) -> bool:
        async with session.post(ref_url + "/detokenize", json={"tokens": ids}) as response:
            piece = (await response.json())["content"]
        return text.startswith(piece.rstrip("\ufffd"))

    i = 0
    while i < len(expected) and await follows(expected[: i + 1]):
        i += 1
    if i == len(expected):
        return "unexplained"  # the whole reference is in it: not a divergence
    ids, gap = await top2_gap(session, ref_url, ref["prompt"] + expected[:i])
    runner_up = next((t for t in ids if t != expected[i]), None)
    near = gap < NEAR_TIE_LOGIT_GAP and runner_up is not None
    return "near_tie" if near and await follows([*expected[:i], runner_up]) else "unexplained"


async def main_async(args: argparse.Namespace) -> int:
    binary = find_llama_server(args.llama_server)
    target, drafter = args.models / "target.gguf", args.models / "draft"
    ref, refs = await references(args, binary, target)
    await ref.stop()
    port = free_port()
    config = {
        "target": str(target), "drafter": str(drafter), "llama_server": str(binary),
        "port": port, "k": args.k, "ctx": 1024, "threads": args.threads,
        "passthrough_slots": args.streams - 1, "plain_runs": "off", "draft_timeout_s": 3.0,
        "provider": "cpu", "max_queue": 64, "seed": args.seed, "fault_rate": args.fault_rate,
    }  # fmt: skip
    log = open(args.log, "ab")  # noqa: SIM115 - the child's log, open for its life
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", json.dumps(config), stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    result: dict = {"options": {k: str(v) for k, v in vars(args).items()}}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for _ in range(600):
                if await _metric(session, url, "npu_spec_streams_active") is not None:
                    break
                await asyncio.sleep(0.5)
            soak = Soak(args, url, refs)
            started = time.monotonic()
            deadline = started + args.duration_s
            rss: list[tuple[float, float]] = []
            parts: dict[str, list[tuple[float, float]]] = {"RssAnon": [], "RssFile": []}

            async def sample() -> None:
                while time.monotonic() < deadline:
                    now = time.monotonic() - started
                    value = rss_mb(proc.pid)
                    if value is not None:
                        rss.append((now, value))
                    for field, series in parts.items():
                        if (value := rss_mb(proc.pid, field)) is not None:
                            series.append((now, value))
                    await asyncio.sleep(5)

            await asyncio.gather(
                *(soak.worker(session, deadline, i) for i in range(args.streams)),
                soak.killer(proc.pid, deadline),
                sample(),
            )
            await asyncio.sleep(3)
            after_warmup = [v for t, v in rss if t >= args.warmup_s] or [v for _, v in rss]
            result.update(
                counts=dict(soak.counts),
                rss_mb_first=after_warmup[0] if after_warmup else None,
                rss_mb_last=after_warmup[-1] if after_warmup else None,
                # the last sample may fall in a drafter reload (the old model lives until
                # its sessions end, the new one is loaded): also the medians of the first
                # and the last minute after warm-up, the peak, and the RSS once idle
                rss_mb_first_min_median=_median_within(rss, args.warmup_s, 60, first=True),
                rss_mb_last_min_median=_median_within(rss, args.warmup_s, 60, first=False),
                rss_mb_peak=max(after_warmup, default=None),
                rss_mb_idle_after=rss_mb(proc.pid),
                # the anonymous part (the heap, where a leak shows) and the file-backed
                # part (mapped weights paged in), medians of the first and last minute
                rss_parts_mb={
                    field: {
                        "first_min_median": _median_within(series, args.warmup_s, 60, True),
                        "last_min_median": _median_within(series, args.warmup_s, 60, False),
                        "idle_after": rss_mb(proc.pid, field),
                    }
                    for field, series in parts.items()
                },
                rss_mb_series=[[round(t), round(v, 1)] for t, v in rss],
                server_restarts=await _metric(session, url, "npu_spec_server_restarts_total"),
                drafter_faults=await _metric(session, url, "npu_spec_drafter_faults_total"),
                drafter_reloads=await _metric(session, url, "npu_spec_drafter_reloads_total"),
                streams_active_after=await _metric(session, url, "npu_spec_streams_active"),
                drafter_sessions_open_after=await _metric(
                    session, url, "npu_spec_drafter_sessions_open"
                ),
                yields=await _metric(session, url, "npu_spec_speculation_yields_total"),
            )
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
    ref = LlamaServerProcess(binary, target, ["-t", "1", "-c", "2048", "-np", "1"])
    await ref.start()
    try:
        result["greedy"] = await check(soak, ref.base_url)
        result["stream_differences"] = soak.stream_differences
    finally:
        await ref.stop()
    result["rss_growth_pct"] = _growth_pct(result["rss_mb_first"], result["rss_mb_last"])
    result["rss_growth_median_pct"] = _growth_pct(
        result["rss_mb_first_min_median"], result["rss_mb_last_min_median"]
    )
    for part in result["rss_parts_mb"].values():
        part["growth_median_pct"] = _growth_pct(part["first_min_median"], part["last_min_median"])
    counts, greedy = result["counts"], result["greedy"]
    print(json.dumps(result, indent=1))
    print(
        f"| {args.duration_s / 60:g} min | {args.streams} | {counts.get('server_kills', 0)} | "
        f"{result['server_restarts']} | {result['drafter_faults']} | "
        f"{sum(v for k, v in counts.items() if k.startswith('sent_'))} | "
        f"{counts.get('aborted', 0)} | {counts.get('clean_error', 0)} | "
        f"{counts.get('lost', 0)} | {counts.get('garbled', 0)} | "
        f"{greedy.get('unexplained', 0) + greedy.get('stream_unexplained', 0)} "
        f"({greedy.get('near_tie', 0) + greedy.get('stream_near_tie', 0)} near-ties) | "
        f"{result['rss_growth_pct']}% (medians of first and last minute: "
        f"{result['rss_growth_median_pct']}%; peak {result['rss_mb_peak']} MiB; anonymous "
        f"{result['rss_parts_mb']['RssAnon']['growth_median_pct']}%, file-backed "
        f"{result['rss_parts_mb']['RssFile']['growth_median_pct']}%) |"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = counts.get("lost", 0) + counts.get("garbled", 0)
    bad += greedy.get("unexplained", 0) + greedy.get("stream_unexplained", 0)
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="npu-spec make-models folder")
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--duration-s", type=float, default=600.0, help="load time (bounded)")
    parser.add_argument("--kill-every-s", type=float, default=150.0)
    parser.add_argument("--streams", type=int, default=8, help="concurrent clients")
    parser.add_argument("--fault-rate", type=float, default=0.2, help="draft sessions that fail")
    parser.add_argument("--abort-rate", type=float, default=0.15, help="requests abandoned")
    parser.add_argument("--n-predict", type=int, default=48)
    parser.add_argument("--phase-s", type=float, default=45.0, help="quiet third, busy rest")
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="llama-server -t")
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--warmup-s", type=float, default=60.0, help="RSS baseline after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("/tmp/npu-spec-soak-proxy.log"))
    parser.add_argument("-o", "--out", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
