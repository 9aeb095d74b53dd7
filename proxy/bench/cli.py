"""Options of `npu-spec bench` and `scripts/bench.py`, and the entry point."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import tempfile
from pathlib import Path

from proxy.bench.branches import DEFAULT_BRANCHES
from proxy.bench.modes import MODE_KINDS
from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP
from proxy.bench.options import comma_choices, context_list, float_list, int_list, parse_variant

log = logging.getLogger(__name__)


def _modes(text: str) -> list[str]:
    return comma_choices(text, MODE_KINDS, "modes")


def _variant(text: str) -> tuple[str, list[str]]:
    variant = parse_variant(text)
    return variant.name, variant.args


def _mode_k(text: str) -> tuple[str, list[int]]:
    """'builtin=2,4,6' -> ('builtin', [2, 4, 6])."""
    kind, sep, ks = text.partition("=")
    kinds = comma_choices(kind, MODE_KINDS, "modes")
    values = int_list(ks)
    if not sep or len(kinds) != 1 or kinds[0] == "plain" or not values:
        raise argparse.ArgumentTypeError(f"--mode-k {text!r}: write MODE=K[,K...], e.g. proxy=4")
    return kinds[0], values


def draft_shape_of(*folders: Path | None) -> str:
    """The draft's shape from the first models folder with a manifest.json that
    names one (`npu-spec make-models --draft-shape`); "core" when none does."""
    for folder in folders:
        manifest = folder / "manifest.json" if folder is not None else None
        if manifest is not None and manifest.is_file():
            try:
                shape = json.loads(manifest.read_text()).get("draft_shape")
            except (OSError, ValueError, AttributeError):
                continue
            if shape:
                return str(shape)
    return "core"


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
        "--modes",
        type=_modes,
        default=["plain", "builtin", "proxy", "oracle"],
        help=f"comma list of {', '.join(MODE_KINDS)} (default: all but builtin-synth); "
        "builtin-synth: llama-server's --spec-synth-rates at each --oracle-acceptance "
        "(benchmarking only: output not valid, not compared with plain)",
    )
    parser.add_argument("-k", type=int_list, default=[4], dest="ks", help="k sweep, e.g. 2,4,6,8")
    parser.add_argument(
        "--mode-k",
        type=_mode_k,
        action="append",
        dest="mode_ks",
        metavar="MODE=K[,K...]",
        help="run MODE only at these k (repeatable), e.g. --mode-k proxy=4 --mode-k oracle=4 "
        "with -k 2,4,6: builtin at 2, 4 and 6, proxy and oracle at 4 only",
    )
    parser.add_argument(
        "--context",
        type=context_list,
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
    parser.add_argument(
        "--oracle-acceptance",
        type=float_list,
        default=[0.8],
        help="e.g. 0.6,0.8 (also builtin-synth's a)",
    )
    parser.add_argument(
        "--oracle-delay-ms",
        type=float,
        default=0.0,
        help="per drafted token, e.g. 11 (NPU 91 tok/s)",
    )
    parser.add_argument(
        "--oracle-delay-steps",
        type=float_list,
        metavar="X[,X...]",
        help="the oracle's delay per token as a fraction X of the plain step measured on "
        "the same server and context, e.g. 0.12,0.27 (replaces --oracle-delay-ms)",
    )
    parser.add_argument(
        "--ceiling-ks",
        type=int_list,
        default=[1, 2, 3, 4, 6, 8],
        help="k values at which each context's k+1-prompt round cost t_v(k) is measured "
        "for the ideal and overlap columns ('none': no ceilings)",
    )
    parser.add_argument(
        "--ceiling-repeats", type=int, default=8, help="timed rounds per k for t_v(k)"
    )
    parser.add_argument("--oracle-seed", type=int, default=0, help="oracle drafter's random seed")
    parser.add_argument(
        "--oracle-runner-up-hits",
        type=float_list,
        default=[0.0],
        metavar="H[,H...]",
        help="the share of the oracle's wrong drafts whose runner-up is the target's token "
        "(the engine drafts the lines after runner-ups while the server verifies, "
        "--runner-up-lines); default 0: none",
    )
    parser.add_argument(
        "--oracle-branches",
        type=int,
        default=DEFAULT_BRANCHES,
        metavar="N",
        help="per reference, record the target's greedy continuation after the runner-up at "
        "its N closest near-ties (top-2 logit gap under --branch-margin), so the oracle "
        "follows a flipped tie; one plain request each, before any measurement (0: none)",
    )
    parser.add_argument(
        "--oracle-sub-branches",
        type=int,
        default=0,
        metavar="N",
        help="per recorded branch, also its N closest near-ties' continuations, so the "
        "oracle follows a run that flips a second tie (two plain requests each and one "
        "more per branch; default 0: none)",
    )
    parser.add_argument(
        "--branch-margin",
        type=float,
        default=NEAR_TIE_LOGIT_GAP,
        metavar="GAP",
        help="top-2 logit gap under which a position counts as a near-tie for "
        f"--oracle-branches (default {NEAR_TIE_LOGIT_GAP}; excusing a mismatch keeps "
        f"{NEAR_TIE_LOGIT_GAP} whatever this is)",
    )
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
        "--warmup",
        choices=["context", "short"],
        default="context",
        help="each mode's warm-up request before its measured ones: context (default: a "
        "prompt outside --prompt-ids at the same context, n_predict tokens, so the proxy's "
        "policies have measured this context as a running proxy has; its tok/s is kept in "
        "the JSON's instances) or short (a 32-token request on a short prompt)",
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
    for mode, example in (
        ("proxy", "e.g. 'defaults' where the real drafter is slow"),
        ("oracle", "so the real drafter and the oracle share a run with their own variants"),
    ):
        parser.add_argument(
            f"--{mode}-mode-variants",
            type=lambda text: [name.strip() for name in text.split(",")],
            metavar="NAME[,NAME...]",
            help=f"the --proxy-variant names the {mode} mode runs (default: all), {example}",
        )
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="turns per conversation (a chat workload): each turn's prompt is the last "
        "turn's, its plain answer (-n tokens) and a follow-up question, e.g. --turns 3 -n 400",
    )
    parser.add_argument(
        "--regime",
        metavar="NAME|FILE.toml",
        help="run against the regime server instead of llama-server: llama-server's API and "
        "slot semantics with a scripted target, charging what the regime file's machine "
        "charges (proxy/bench/regime/regimes: h200-cuda-14b-f16, strix-halo-vulkan-32b, ...)",
    )
    parser.add_argument(
        "--concurrency",
        type=int_list,
        metavar="N[,N...]",
        help="many users at once: bursts of N concurrent streaming requests, llama-server "
        "alone and `npu-spec serve` (managed) side by side with the same slots, e.g. "
        "1,2,4,8 (modes plain, proxy, oracle; the first -k; --proxy-variant adds columns)",
    )
    parser.add_argument(
        "--ctx", type=int, default=2048, help="--concurrency: context per slot (tokens)"
    )
    parser.add_argument(
        "-o", "--out", type=Path, help="result JSON (default: benchmarks/results/bench-<time>.json)"
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="run nothing: print the cost model's prediction for the seed's Strix Halo "
        "numbers (see proxy.bench.predict); with --report RESULT.json, the engine "
        "efficiency (meas/overlap) comes from its proxy rows",
    )
    parser.add_argument(
        "--engine-efficiency",
        type=float,
        help="--predict: the proxy's meas/overlap to apply (default: from --report, else 1)",
    )
    parser.add_argument(
        "--predict-acceptance",
        type=float_list,
        help="--predict: i.i.d. acceptance values (default: solved from the seed's table)",
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
    llama_server = args.llama_server
    if args.regime:
        from proxy.bench.regime.__main__ import write_launcher

        folder = Path(tempfile.mkdtemp(prefix="npu-spec-regime-"))
        llama_server = write_launcher(args.regime, folder / "regime-server")
        if target is None:  # the regime server reads no model: a named placeholder
            target = folder / f"regime-{Path(args.regime).stem}.gguf"
            target.write_text("placeholder: the regime server's scripted target\n")
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
        oracle_delay_steps=args.oracle_delay_steps,
        mode_ks=dict(args.mode_ks or []),
        ceiling_ks=args.ceiling_ks,
        ceiling_repeats=args.ceiling_repeats,
        draft_shape=draft_shape_of(
            args.models,
            draft_gguf.parent if draft_gguf else None,
            drafter.parent if drafter else None,
        ),
        oracle_seed=args.oracle_seed,
        oracle_runner_up_hits=args.oracle_runner_up_hits,
        oracle_branches=args.oracle_branches,
        oracle_sub_branches=args.oracle_sub_branches,
        branch_margin=args.branch_margin,
        llama_server=llama_server,
        work_dir=args.work_dir,
        startup_timeout=args.startup_timeout,
        time_budget_s=args.time_budget_s,
        exact_check=args.exact_check,
        warmup=args.warmup,
        proxy_variants=args.proxy_variants or [("", [])],
        proxy_mode_variants=args.proxy_mode_variants,
        oracle_mode_variants=args.oracle_mode_variants,
        turns=args.turns,
        regime=args.regime,
    )


def report(path: Path) -> int:
    """Re-summarise a saved result's runs (summaries are pure functions of them)."""
    from proxy.bench.report import render_table
    from proxy.bench.stats import summary_rows

    result = json.loads(path.read_text())
    shape = (result.get("options") or {}).get("draft_shape", "core")
    result["summary"] = summary_rows(
        result["runs"], result["instances"], result.get("round_costs"), shape
    )
    print(render_table(result))
    return 0


def run(args: argparse.Namespace) -> int:
    from proxy.bench.report import render_table
    from proxy.bench.results import default_result_path, write_json
    from proxy.bench.runner import run_bench

    if args.predict:
        from proxy.bench.predict import print_prediction

        return print_prediction(args.report, args.engine_efficiency, args.predict_acceptance)
    if args.report is not None:
        return report(args.report)

    if args.concurrency:
        return run_concurrency_cli(args)
    options = options_from_args(args)
    if options.target is None:
        log.error("give --target model.gguf or --models DIR")
        return 2
    if {"builtin", "builtin-synth"} & set(options.modes) and options.draft_gguf is None:
        log.error("the builtin modes need --draft-gguf (or --models)")
        return 2
    if "proxy" in options.modes and options.drafter is None:
        log.error("the proxy mode needs --drafter (or --models)")
        return 2
    names = {name for name, _ in options.proxy_variants}
    for flag, wanted in (
        ("--proxy-mode-variants", options.proxy_mode_variants),
        ("--oracle-mode-variants", options.oracle_mode_variants),
    ):
        unknown = sorted(set(wanted or ()) - names)
        if unknown:
            log.error("%s %s: no such --proxy-variant", flag, ",".join(unknown))
            return 2
    if options.oracle_delay_steps is not None and not options.ceiling_ks:
        log.error("--oracle-delay-steps needs the plain step: give --ceiling-ks (not 'none')")
        return 2
    out = args.out or default_result_path("bench")
    result = asyncio.run(run_bench(options, progress=out))
    write_json(result, out)
    print(render_table(result))
    print(f"\nraw results: {out}")
    bad = [
        e for e in result["summary"]
        if e["summary"]["n_equal_to_plain"] != e["summary"]["n_compared"]
    ]  # fmt: skip
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


def run_concurrency_cli(args: argparse.Namespace) -> int:
    from proxy.bench.concurrency import ConcurrencyOptions, render, run_concurrency
    from proxy.bench.results import default_result_path, write_json
    from proxy.server.llama_server import find_llama_server

    options = options_from_args(args)
    if options.target is None:
        log.error("give --target model.gguf or --models DIR")
        return 2
    if "proxy" in options.modes and options.drafter is None:
        log.error("the proxy mode needs --drafter (or --models)")
        return 2
    work = options.work_dir or Path(tempfile.mkdtemp(prefix="npu-spec-concurrency-"))
    concurrency = ConcurrencyOptions(
        target=options.target,
        llama_server=find_llama_server(options.llama_server),
        levels=args.concurrency,
        k=options.ks[0],
        n_predict=options.n_predict,
        repeats=options.repeats,
        ctx=args.ctx,
        threads=options.threads,
        server_args=options.server_args,
        drafter=options.drafter,
        modes=[m for m in options.modes if m in ("plain", "proxy", "oracle")],
        proxy_variants=options.proxy_variants,
        oracle_acceptance=options.oracle_acceptance[0],
        oracle_delay_ms=options.oracle_delay_ms,
        oracle_seed=options.oracle_seed,
        provider=options.provider,
        work_dir=work,
        startup_timeout=options.startup_timeout,
    )
    result = asyncio.run(run_concurrency(concurrency))
    out = args.out or default_result_path("concurrency")
    write_json(result, out)
    print(render(result))
    print(f"\nraw results: {out}")
    return 1 if any(row["errors"] for row in result["rows"]) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)
