"""Options of `npu-spec bench` and `scripts/bench.py`, and the entry point."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
from pathlib import Path

from proxy.bench.modes import MODE_KINDS

log = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _contexts(text: str) -> list[int | None]:
    """'natural,512,4096' -> [None, 512, 4096]; 4k is accepted for 4096."""
    out: list[int | None] = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        if item in ("natural", "none", "0"):
            out.append(None)
        elif item.endswith("k"):
            out.append(int(float(item[:-1]) * 1024))
        else:
            out.append(int(item))
    return out


def comma_choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`."""
    items = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in items if m not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; from {', '.join(allowed)}")
    return items


def _modes(text: str) -> list[str]:
    return comma_choices(text, MODE_KINDS, "modes")


def _variant(text: str) -> tuple[str, list[str]]:
    from proxy.bench.verify_cost import parse_variant

    variant = parse_variant(text)
    return variant.name, variant.args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, help="target GGUF (or --models)")
    parser.add_argument("--draft-gguf", type=Path, help="draft GGUF for the builtin mode")
    parser.add_argument("--drafter", type=Path, help="drafter folder for the proxy mode")
    parser.add_argument(
        "--models",
        type=Path,
        help="a `npu-spec make-models` folder: sets --target, --draft-gguf and --drafter",
    )
    parser.add_argument(
        "--modes", type=_modes, default=list(MODE_KINDS), help="comma list (default: all four)"
    )
    parser.add_argument("-k", type=_int_list, default=[4], dest="ks", help="k sweep, e.g. 2,4,6,8")
    parser.add_argument(
        "--context",
        type=_contexts,
        default=[None],
        dest="contexts",
        help="prompt lengths: natural (as written; the long prompt ~4k) or tokens, e.g. 512,4k",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each prompt per mode")
    parser.add_argument(
        "-n", "--n-predict", type=int, default=128, dest="n_predict", help="tokens per request"
    )
    parser.add_argument("--prompts", type=Path, dest="prompts_path", help="prompt set JSON")
    parser.add_argument("--prompt-ids", help="comma list: only these prompts")
    parser.add_argument(
        "--server-args",
        default="",
        help="extra llama-server args for every mode (= form): --server-args='-ngl 99 -fa on'",
    )
    parser.add_argument(
        "--builtin-args",
        default="",
        help="extra args for the builtin mode only: --builtin-args='-ngld 99'",
    )
    parser.add_argument("-t", "--threads", type=int, help="llama-server -t (and -td)")
    parser.add_argument("--provider", default="auto", help="drafter provider: auto, npu, cuda, cpu")
    parser.add_argument("--oracle-acceptance", type=_float_list, default=[0.8], help="e.g. 0.6,0.8")
    parser.add_argument(
        "--oracle-delay-ms",
        type=float,
        default=0.0,
        help="per drafted token, e.g. 11 (NPU 91 tok/s)",
    )
    parser.add_argument("--oracle-seed", type=int, default=0, help="oracle drafter's random seed")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary")
    parser.add_argument("--work-dir", type=Path, help="logs and oracle folders (default: temp)")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for a server to load"
    )
    parser.add_argument(
        "--exact-check",
        choices=["first", "all", "none"],
        default="first",
        help="repeat each request non-streamed to compare exact token ids with plain: in the "
        "first repeat (default), in all, or never (then streamed ids and text are compared)",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        help="start no new mode after this many seconds (the JSON keeps what ran)",
    )
    parser.add_argument(
        "--proxy-variant",
        action="append",
        type=_variant,
        dest="proxy_variants",
        metavar="NAME=OPTIONS",
        help="run proxy and oracle once per variant with these extra `npu-spec serve` options, "
        "e.g. --proxy-variant 'turns=--fixed-k --no-overlap' (repeatable; NAME= alone: defaults)",
    )
    parser.add_argument(
        "-o", "--out", type=Path, help="result JSON (default: benchmarks/results/bench-<time>.json)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="RESULT.json",
        help="run nothing: print the table of a saved result, summarised by this version",
    )


def options_from_args(args: argparse.Namespace):
    from proxy.bench.runner import BenchOptions

    target, draft_gguf, drafter = args.target, args.draft_gguf, args.drafter
    if args.models is not None:
        target = target or args.models / "target.gguf"
        draft_gguf = draft_gguf or args.models / "draft.gguf"
        drafter = drafter or args.models / "draft"
    return BenchOptions(
        target=target,
        draft_gguf=draft_gguf,
        drafter=drafter,
        modes=args.modes,
        ks=args.ks,
        contexts=args.contexts,
        repeats=args.repeats,
        n_predict=args.n_predict,
        prompts_path=args.prompts_path,
        prompt_ids=args.prompt_ids.split(",") if args.prompt_ids else None,
        server_args=shlex.split(args.server_args),
        builtin_args=shlex.split(args.builtin_args),
        threads=args.threads,
        provider=args.provider,
        oracle_acceptance=args.oracle_acceptance,
        oracle_delay_ms=args.oracle_delay_ms,
        oracle_seed=args.oracle_seed,
        llama_server=args.llama_server,
        work_dir=args.work_dir,
        startup_timeout=args.startup_timeout,
        time_budget_s=args.time_budget_s,
        exact_check=args.exact_check,
        proxy_variants=args.proxy_variants or [("", [])],
    )


def report(path: Path) -> int:
    """Re-summarise a saved result's runs (summaries are pure functions of them)."""
    from proxy.bench.report import render_table
    from proxy.bench.stats import summary_rows

    result = json.loads(path.read_text())
    result["summary"] = summary_rows(result["runs"], result["instances"])
    print(render_table(result))
    return 0


def run(args: argparse.Namespace) -> int:
    from proxy.bench.report import render_table
    from proxy.bench.runner import default_result_path, run_bench, write_json

    if args.report is not None:
        return report(args.report)

    options = options_from_args(args)
    if options.target is None:
        log.error("give --target model.gguf or --models DIR")
        return 2
    if "builtin" in options.modes and options.draft_gguf is None:
        log.error("the builtin mode needs --draft-gguf (or --models)")
        return 2
    if "proxy" in options.modes and options.drafter is None:
        log.error("the proxy mode needs --drafter (or --models)")
        return 2
    out = args.out or default_result_path("bench")
    result = asyncio.run(run_bench(options, progress=out))
    write_json(result, out)
    print(render_table(result))
    print(f"\nraw results: {out}")
    bad = [
        e for e in result["summary"] if e["summary"]["n_equal_to_plain"] != e["summary"]["n_runs"]
    ]
    for entry in bad:
        log.warning(
            "%s k=%d ctx=%s: output differs from plain", entry["mode"], entry["k"], entry["context"]
        )
    for entry in result["summary"]:
        if entry["summary"].get("drafter_failures"):
            log.warning("%s k=%d ctx=%s: the drafter failed in %d requests (plain decoding)",
                        entry["mode"], entry["k"], entry["context"],
                        entry["summary"]["drafter_failures"])  # fmt: skip
    for error in result["errors"]:
        log.error("failed: %s k=%d ctx=%s repeat %d: %s", error["mode"], error["k"],
                  error["context"], error["repeat"], error["error"])  # fmt: skip
    return 1 if result["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)
