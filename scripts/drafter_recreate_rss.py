"""RSS of one process that re-creates its drafter N times, the way `npu-spec serve` does
after drafter faults (issue 30: the proxy's RSS grew ~15 MiB per re-creation).

The loop is the proxy's own path: `serve_cmd._drafter_opener` loads the drafter, a
`DrafterSupervisor` with `serve_cmd._drafter_reloader` hands out sessions
(`AsyncSessionDrafter`: a worker thread each), every session drafts a few tokens and is
closed, then a failure is reported, so the next `open()` reloads the drafter's model.

    python scripts/drafter_recreate_rss.py MODELS/draft -n 12
    python scripts/drafter_recreate_rss.py MODELS/draft -n 12 --backend onnx

Prints the RSS after each re-creation and the growth per re-creation over the second
half (the first re-creations may still grow allocator pools).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import sys
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from npu_draft.tokenizer_check import drafter_facts  # noqa: E402
from proxy import serve_cmd  # noqa: E402
from proxy.config import ProxySettings  # noqa: E402
from proxy.drafter_guard import DrafterSupervisor  # noqa: E402


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS), or a part of it (RssAnon, RssFile)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def malloc_trim() -> None:
    """glibc: give free heap memory of every arena back to the system (diagnostic)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


async def one_stream(supervisor: DrafterSupervisor, sessions: int, tokens: int, seed: int) -> None:
    """One client's requests between faults: open a session, take in a prompt, draft a
    few rounds, close it."""
    for i in range(sessions):
        drafter = await supervisor.open()
        assert drafter is not None, "the drafter failed to open"
        try:
            committed = [1 + (seed * 7919 + j * 31 + i) % 5000 for j in range(tokens)]
            for _ in range(4):
                committed += await drafter.propose(committed, 3)
        finally:
            await drafter.close()
            supervisor.session_closed()


async def use_once(supervisor: DrafterSupervisor, args: argparse.Namespace, fault: bool) -> None:
    """What `--streams` clients do between faults; with `fault`, one stream's failure
    is reported while the others still hold sessions of the old drafter (what the
    proxy does when a proposal fails)."""
    streams = [
        one_stream(supervisor, args.sessions, args.tokens, seed) for seed in range(args.streams)
    ]
    if fault:

        async def fail_soon() -> None:
            await asyncio.sleep(0.05)
            # the reload is what is measured (a lone session fault only opens a new session)
            supervisor.report_failure("measurement", model_suspect=True)

        streams.append(fail_soon())
    await asyncio.gather(*streams)


async def run(args: argparse.Namespace) -> dict:
    folder = Path(args.drafter)
    target = drafter_facts(folder)  # the target the proxy would check it against
    settings = ProxySettings(
        upstream="http://127.0.0.1:1",
        drafter=str(folder),
        provider="cpu",
        drafter_threads=args.threads,
    )
    if args.backend != "auto":  # the proxy has no backend flag: force it in load_drafter
        import npu_draft.load as load

        real = load._folder_backend
        load._folder_backend = lambda f, b: real(f, args.backend)  # type: ignore[assignment]
    series: list[float] = [rss_mib()]
    print(f"before load: {series[0]:.0f} MiB", flush=True)
    models = _track_models()
    # what `serve` keeps for its whole run: the opener (in ProxyState) and what
    # _load_drafter returned (in _Running), and the reloader it hands the supervisor
    opener, loaded = await serve_cmd._load_drafter(settings, target)
    reload = serve_cmd._drafter_reloader(loaded)
    supervisor = DrafterSupervisor(opener, reload)
    await use_once(supervisor, args, fault=False)
    gc.collect()
    series.append(rss_mib())
    print(f"loaded, sessions used: {series[-1]:.0f} MiB", flush=True)
    alive: list[int] = []
    before_gc: list[int] = []  # models alive before gc.collect(): >1 means a cycle holds one
    while supervisor.recreations < args.n:
        before = supervisor.recreations
        started = time.perf_counter()
        await use_once(supervisor, args, fault=True)
        if supervisor.recreations == before:  # the fault came after the last open
            await use_once(supervisor, args, fault=False)
        await asyncio.sleep(0.2)  # a trim the proxy started in a thread ends
        before_gc.append(sum(ref() is not None for ref in models))
        gc.collect()
        if args.trim:
            malloc_trim()
        series.append(rss_mib())
        alive.append(sum(ref() is not None for ref in models))
        print(
            f"re-creation {supervisor.recreations:2d}: {series[-1]:7.0f} MiB  "
            f"({series[-1] - series[-2]:+6.1f}; anon {rss_mib('RssAnon'):.0f}, file "
            f"{rss_mib('RssFile'):.0f})  models alive {alive[-1]} "
            f"({before_gc[-1]} before gc) of {len(models)}  "
            f"{(time.perf_counter() - started):.1f} s",
            flush=True,
        )
    half = series[1 + args.n // 2 :]
    per = (half[-1] - half[0]) / max(1, len(half) - 1)
    return {
        "drafter": str(folder),
        "backend": args.backend,
        "trim": args.trim,
        "recreations": supervisor.recreations,
        "streams": args.streams,
        "rss_mib": [round(v, 1) for v in series],
        "models_alive": alive,
        "models_alive_before_gc": before_gc,
        "mib_per_recreation_second_half": round(per, 2),
        "growth_pct_after_first": round(100 * (series[-1] - series[1]) / series[1], 1),
    }


def _track_models() -> list[weakref.ref]:
    """Weak references to every drafter model loaded from now on (through
    `npu_draft.load.load_drafter`, as serve_cmd loads them)."""
    import npu_draft.load as load

    refs: list[weakref.ref] = []
    real = load.load_drafter

    def tracked(*args, **kwargs):
        model = real(*args, **kwargs)
        refs.append(weakref.ref(model))
        return model

    load.load_drafter = tracked  # serve_cmd imports it at call time
    return refs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="a drafter folder (make-models OUT/draft)")
    parser.add_argument("-n", type=int, default=12, help="re-creations")
    parser.add_argument("--sessions", type=int, default=2, help="sessions per stream per fault")
    parser.add_argument("--streams", type=int, default=4, help="concurrent clients")
    parser.add_argument("--tokens", type=int, default=200, help="prompt tokens per session")
    parser.add_argument("--backend", choices=("auto", "onnx", "genai"), default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--trim", action="store_true", help="malloc_trim(0) before each sample (diagnostic)"
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
