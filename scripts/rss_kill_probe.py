#!/usr/bin/env python3
"""Diagnostic: what the proxy's RSS keeps after a llama-server kill or a drafter reload.

Runs `npu-spec serve` (managed mode, the soak's child, no random faults) as a child
process with a probe installed in it: on SIGUSR1 the child writes a report (RSS,
glibc `mallinfo2` in-use and free arena bytes, RSS after `gc.collect()` and after
`malloc_trim(0)`, the top tracemalloc allocation sites against the previous report,
live object counts by type against the previous report); on SIGUSR2 it reports a
drafter failure with `model_suspect=True`, so the next session reloads the model.
The parent drives `--streams` greedy clients (scripts/soak.py's request kinds),
pauses them before each report, and triggers the events.

    python scripts/rss_kill_probe.py --models .cache/test-models/small-same-s0-... \\
        --event kill --events 4 -o /tmp/probe-kill.json
    python scripts/rss_kill_probe.py --models ... --event reload --events 4

`--tracemalloc N` (frames; 0 = off) costs time and memory in the child: compare RSS
steps with it off too.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import soak  # noqa: E402  (scripts/soak.py: its client request kinds and helpers)

# -- the child: the proxy with the probe -------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc():
    return ctypes.CDLL("libc.so.6")


def mallinfo() -> dict[str, float]:
    """glibc totals over all arenas, MiB: arena (sbrk'd + arena heaps), in use, free,
    mmapped blocks."""
    libc = _libc()
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    mib = 1 / 1048576
    return {
        "arena_mib": round(info.arena * mib, 1),
        "in_use_mib": round(info.uordblks * mib, 1),
        "free_mib": round(info.fordblks * mib, 1),
        "mmapped_mib": round(info.hblkhd * mib, 1),
        "mmapped_blocks": info.hblks,
    }


def status_fields() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            value = int(line.split()[1])
            out[key] = value if key == "Threads" else round(value / 1024, 1)
    return out


def arena_count() -> int:
    """Mappings that look like glibc thread-arena heaps (64 MiB reserved regions)."""
    n = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if end - start == 64 << 20 or (line.split()[1].startswith("rw") and end - start > 60 << 20):
            n += 1
    return n


def rss_by_mapping(top: int = 6) -> list[list]:
    """/proc/self/smaps: resident MiB per mapped file (anonymous mappings as one row)."""
    sizes: Counter[str] = Counter()
    name = "[anon]"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else "[anon]"
            name = name if name.startswith("/") else "[anon]"
        elif fields and fields[0] == "Rss:":
            sizes[name.rsplit("/", 1)[-1] if name != "[anon]" else name] += int(fields[1])
    return [[k, round(v / 1024, 1)] for k, v in sizes.most_common(top)]


class Probe:
    def __init__(self, out_dir: Path, frames: int) -> None:
        self.out_dir, self.frames = out_dir, frames
        self.n = 0
        self.snapshot = None
        self.types: Counter[str] | None = None
        self.supervisors: list = []
        if frames:
            import tracemalloc

            tracemalloc.start(frames)

    def report(self, trim: bool = True) -> None:
        started = time.perf_counter()
        record: dict = {"n": self.n, "t": time.time()}
        record["before"] = {**status_fields(), **mallinfo()}
        gc.collect()
        record["after_gc"] = {**status_fields(), **mallinfo()}
        types = Counter(type(o).__name__ for o in gc.get_objects())
        if self.types is not None:
            diff = Counter(types)
            diff.subtract(self.types)
            record["types_diff"] = [
                [k, v] for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15] if v
            ]
        self.types = types
        record["gc_objects"] = sum(types.values())
        if self.frames:
            import tracemalloc

            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            record["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 1048576, 2)
            if self.snapshot is not None:
                stats = snapshot.compare_to(self.snapshot, "traceback")[:15]
                record["top_diff"] = [
                    {
                        "size_diff_kib": round(s.size_diff / 1024, 1),
                        "count_diff": s.count_diff,
                        "size_kib": round(s.size / 1024, 1),
                        "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                                  for f in s.traceback][:6],
                    }
                    for s in stats
                ]  # fmt: skip
            self.snapshot = snapshot
        if trim:
            _libc().malloc_trim(0)
        record["trimmed"] = trim
        record["after_trim"] = {**status_fields(), **mallinfo()}
        record["arenas_64mib_maps"] = arena_count()
        record["rss_by_mapping"] = rss_by_mapping()
        record["supervisor"] = [s.snapshot() for s in self.supervisors]
        record["took_s"] = round(time.perf_counter() - started, 2)
        (self.out_dir / f"report-{self.n:02d}.json").write_text(json.dumps(record) + "\n")
        self.n += 1

    def fail_drafter(self) -> None:
        for supervisor in self.supervisors:
            supervisor.report_failure("probe: forced reload", model_suspect=True)


def child(config: dict) -> int:
    import logging

    from proxy import drafter_guard, serve_cmd
    from proxy.config import ProxySettings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    probe = Probe(Path(config.pop("probe_dir")), config.pop("tracemalloc"))
    rate, rng = config.pop("fault_rate"), random.Random(config.pop("seed"))
    if rate > 0:  # scripts/soak.py's drafter faults
        load, reloader = serve_cmd._load_drafter, serve_cmd._drafter_reloader

        async def load_faulty(settings, facts):
            factory, model = await load(settings, facts)
            return (soak._faulty(factory, rate, rng) if factory else None), model

        def reload_faulty(loaded):
            reload = reloader(loaded)
            return lambda: soak._faulty(reload(), rate, rng)

        serve_cmd._load_drafter, serve_cmd._drafter_reloader = load_faulty, reload_faulty
    init = drafter_guard.DrafterSupervisor.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        probe.supervisors.append(self)

    drafter_guard.DrafterSupervisor.__init__ = recording_init

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, probe.report, False)
        loop.add_signal_handler(signal.SIGHUP, probe.report, True)
        loop.add_signal_handler(signal.SIGUSR2, probe.fail_drafter)
        return await serve_cmd.serve(ProxySettings(**config))

    return asyncio.run(main())


# -- the parent ----------------------------------------------------------------------------


class Load:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.soak = soak.Soak(args, url, refs={})
        self.running = asyncio.Event()
        self.inflight = 0

    async def worker(self, session: aiohttp.ClientSession, deadline: float, number: int) -> None:
        while time.monotonic() < deadline:
            await self.running.wait()
            s = self.soak
            if number > 0 and not s.busy():  # the soak's quiet thirds: one client speculates
                await asyncio.sleep(0.5)
                continue
            prompt = s.rng.randrange(len(soak.PROMPTS))
            roll = s.rng.random()
            kind = "abort" if roll < s.args.abort_rate else "stream" if roll < 0.45 else "json"
            self.inflight += 1
            try:
                async with asyncio.timeout(60):
                    outcome = await getattr(s, kind)(session, prompt)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                outcome = f"failed:{type(exc).__name__}"
            finally:
                self.inflight -= 1
            s.counts[outcome] += 1
            s.answers.clear()
            s.texts.clear()
            if outcome == "clean_error":
                await asyncio.sleep(0.5)

    async def quiesce(self) -> None:
        self.running.clear()
        while self.inflight:
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)


async def main_async(args: argparse.Namespace) -> int:
    binary = soak.find_llama_server(args.llama_server)
    port = soak.free_port()
    probe_dir = Path(args.probe_dir)
    probe_dir.mkdir(parents=True, exist_ok=True)
    for old in probe_dir.glob("report-*.json"):
        old.unlink()
    config = {
        "target": str(args.models / "target.gguf"), "drafter": str(args.models / "draft"),
        "llama_server": str(binary), "port": port, "k": args.k, "ctx": 1024, "threads": 1,
        "passthrough_slots": args.streams - 1, "plain_runs": "off", "draft_timeout_s": 3.0,
        "provider": "cpu", "max_queue": 64, "max_restarts": 100,
        "probe_dir": str(probe_dir), "tracemalloc": args.tracemalloc,
        "fault_rate": args.fault_rate, "seed": args.seed,
    }  # fmt: skip
    log = open(args.log, "wb")  # noqa: SIM115
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", json.dumps(config), stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    reports: list[dict] = []

    async def report(label: str, final: bool = False) -> None:
        before = len(list(probe_dir.glob("report-*.json")))
        trim = final or args.trim == "each"
        os.kill(proc.pid, signal.SIGHUP if trim else signal.SIGUSR1)
        path = probe_dir / f"report-{before:02d}.json"
        for _ in range(600):
            if path.exists():
                break
            await asyncio.sleep(0.2)
        record = json.loads(path.read_text())
        record["label"] = label
        reports.append(record)
        b, t = record["before"], record["after_trim"]
        print(
            f"{label:>14}: RSS {b['VmRSS']:.1f} (anon {b['RssAnon']:.1f}) -> after "
            f"{'trim' if record['trimmed'] else 'gc'} "
            f"{t['VmRSS']:.1f} (anon {t['RssAnon']:.1f}); malloc in use {b['in_use_mib']}"
            f" free {b['free_mib']} -> free {t['free_mib']}; mmapped {b['mmapped_mib']}; "
            f"threads {b['Threads']}; traced {record.get('traced_mib')}; "
            f"objs {record['gc_objects']}",
            flush=True,
        )
        print(f"      maps: {record['rss_by_mapping']}; arenas {record['arenas_64mib_maps']}; "
              f"drafter {record['supervisor']}", flush=True)  # fmt: skip
        for row in record.get("top_diff", [])[: args.top]:
            print(f"      {row['size_diff_kib']:+9.1f} KiB {row['count_diff']:+6d}  "
                  f"{' < '.join(row['where'][:4])}", flush=True)  # fmt: skip
        if record.get("types_diff"):
            print(f"      types: {record['types_diff'][:8]}", flush=True)

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for _ in range(600):
                if await soak._metric(session, url, "npu_spec_streams_active") is not None:
                    break
                await asyncio.sleep(0.5)
            load = Load(args, url)
            deadline = time.monotonic() + 3600
            workers = [
                asyncio.create_task(load.worker(session, deadline, i)) for i in range(args.streams)
            ]

            async def run_load(seconds: float) -> None:
                load.running.set()
                await asyncio.sleep(seconds)
                await load.quiesce()

            await run_load(args.warmup_s)
            await report("warm")
            await run_load(args.settle_s)
            await report("no event")
            for i in range(args.events):
                load.running.set()
                await asyncio.sleep(5)
                if args.event == "kill":
                    restarts = await soak._metric(session, url, "npu_spec_server_restarts_total")
                    server = soak.llama_server_pid(proc.pid)
                    os.kill(server, signal.SIGKILL)
                    for _ in range(300):
                        await asyncio.sleep(0.5)
                        now = await soak._metric(session, url, "npu_spec_server_restarts_total")
                        if now is not None and restarts is not None and now > restarts:
                            break
                else:
                    reloads = await soak._metric(session, url, "npu_spec_drafter_reloads_total")
                    os.kill(proc.pid, signal.SIGUSR2)
                    for _ in range(300):
                        await asyncio.sleep(0.5)
                        now = await soak._metric(session, url, "npu_spec_drafter_reloads_total")
                        if now is not None and reloads is not None and now > reloads:
                            break
                await run_load(args.settle_s)
                await report(f"{args.event} {i + 1}")
            if args.trim != "each":
                await report("end (trimmed)", final=True)
            for task in workers:
                task.cancel()
            print(dict(load.soak.counts), flush=True)
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--event", choices=["kill", "reload"], default="kill")
    parser.add_argument("--events", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--abort-rate", type=float, default=0.15)
    parser.add_argument("--n-predict", type=int, default=48)
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=20.0, help="load after each event")
    parser.add_argument("--tracemalloc", type=int, default=8, help="frames; 0: off")
    parser.add_argument("--phase-s", type=float, default=30.0, help="as scripts/soak.py")
    parser.add_argument("--fault-rate", type=float, default=0.0, help="as scripts/soak.py")
    parser.add_argument(
        "--trim",
        choices=["each", "end"],
        default="each",
        help="malloc_trim(0) at every report, or only at the last",
    )
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--probe-dir", default="/tmp/rss-probe")
    parser.add_argument("--log", type=Path, default=Path("/tmp/rss-probe-proxy.log"))
    parser.add_argument("-o", "--out", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
