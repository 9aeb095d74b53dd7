"""The benchmark session: references, interleaved modes, summary, JSON.

For each context setting the plain server first writes the reference outputs (the
oracle replays them and every mode is compared to them) and, for the oracle, the
continuations after their near-ties' runners-up (proxy.bench.branches). Then, for each repeat and
each k, every mode is started fresh (proxy and oracle modes on one shared
verification server, see proxy.bench.modes), warmed up, given every prompt,
measured and stopped. Plain, which does not depend on k, runs once per repeat. The
order rotates with the repeat and the k, so drift (thermal, caches, other load)
spreads evenly over the modes.

The result JSON (schema "npu-spec-bench/1"):

- `host`: cpu, gpus (nvidia-smi), python, llama-server path and `--version`;
  `options`: every BenchOptions field; `work_dir`: logs and oracle folders.
- `references`: per context and prompt, prompt and plain-output lengths, and the
  near-tie branches recorded for the oracle (`branches`: position, runner_up, gap,
  n_generated; see proxy.bench.branches).
- `runs`: one per (mode, k, context, repeat, prompt): n_prompt, n_generated,
  ttft_ms, first_n_ms (start to the 32nd token), decode_ms, total_ms, tokens_per_s,
  e2e_tokens_per_s, equal_to_plain, exact_checked, first_mismatch, spec_header
  (X-Npu-Spec), server_timings (the final chunk's `timings`), stats (see
  proxy.bench.stats.request_stats).
  equal_to_plain compares exact ids (a second, non-streamed request) when
  exact_checked, else the streamed ids and text (see proxy.bench.client).
- `instances`: one per started mode: its peak memory (rss_mb.*, gpu_mb.* in MiB;
  GPU memory as nvidia-smi reports it after the last prompt) and its warm-up request
  (`warmup`: prompt id, lengths, tokens_per_s; with `--warmup context`, the default, a
  prompt outside the set at the same context and length, so that what a proxy learns
  on its first request at a context, the plain-run gate's measurements included, is
  seen there and not in the measured requests).
- `round_costs`: per context, measured before the modes on a server started as
  managed mode starts it (same flags, same prompt length): the plain step
  (`plain_ms`) and the k+1-prompt round's wall ms by k (`round_ms`), see
  proxy.bench.verify_cost.measure_round_costs. The oracle's `--oracle-delay-steps`
  and the ceiling columns come from them.
- `errors`: modes that failed or were skipped for time (the session goes on).
- `summary`: one per (context, k, mode): speedup_vs_plain and `summary` (see
  proxy.bench.stats.summarize): tokens/s median/min/max and per repeat, TTFT,
  acceptance, accepted and tokens per round, acceptance per position, the i.i.d.
  acceptance estimate, draft/verify/overhead ms per round, draft ms per token,
  decodes per round, the cost-model prediction and measured/predicted, memory,
  n_equal_to_plain / n_runs and n_speculative; and the flat keys of
  proxy.bench.stats.ROW_KEYS (tok_s, plain_tok_s, ideal_tok_s, overlap_tok_s,
  acceptance, draft_ms_per_token, draft_shape, ...).

builtin-synth runs are "benchmarking only: output not valid": their outputs are not
compared with plain (equal_to_plain is None).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from npu_draft.oracle import Branch, OracleConfig, RecordedReference, write_oracle_folder
from proxy.bench.branches import DEFAULT_BRANCHES, BranchPoint, record_branches
from proxy.bench.client import StreamedCompletion, exact_tokens, stream_completion
from proxy.bench.host import host_info
from proxy.bench.modes import (
    BUILTIN_KINDS,
    DraftStats,
    LlamaServerMode,
    ModeSpec,
    ServeConfig,
    VerifyServer,
    make_instance,
)
from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP, explain_mismatch
from proxy.bench.prompts import BenchPrompt, ServerText, build_prompts, load_prompt_set, select
from proxy.bench.results import jsonable, now_utc, write_json
from proxy.bench.stats import request_stats, summary_rows
from proxy.bench.verify_cost import RoundCosts, measure_round_costs
from proxy.server.llama_server import LlamaServerProcess, find_llama_server

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA = "npu-spec-bench/1"
RESULT_FIELDS = (
    "schema", "started_utc", "finished_utc", "host", "options", "work_dir",
    "references", "round_costs", "summary", "instances", "runs", "errors",
)  # fmt: skip
RUN_FIELDS = (
    "mode", "kind", "k", "context", "repeat", "prompt", "n_prompt", "n_generated",
    "ttft_ms", "first_n_ms", "decode_ms", "total_ms", "tokens_per_s", "e2e_tokens_per_s",
    "equal_to_plain", "exact_checked", "first_mismatch", "spec_header", "server_timings",
    "stats", "valid_output", "mode_params",
)  # fmt: skip
ROUND_COUNTER = "npu_spec_rounds_total"  # the proxy's rounds, see proxy.metrics
WARMUP_TEXT = "Warm-up: count from one to ten."
# Long enough for the batch shapes of many rounds. With an 8-token warm-up the first
# runs of a fresh Vulkan build were erratic (a third of the speed of later runs;
# docs/BENCHMARKS.md), most likely the backend building a pipeline on the first use of
# each batch shape.
WARMUP_TOKENS = 32


@dataclass
class BenchOptions:
    target: Path
    draft_gguf: Path | None = None
    drafter: Path | None = None
    modes: list[str] = field(default_factory=lambda: ["plain", "builtin", "proxy", "oracle"])
    draft_shape: str = "core"  # what the draft costs (the models folder's manifest)
    ks: list[int] = field(default_factory=lambda: [4])
    contexts: list[int | None] = field(default_factory=lambda: [None])  # None: as written
    repeats: int = 3
    n_predict: int = 128
    prompts_path: Path | None = None
    prompt_ids: list[str] | None = None
    server_args: list[str] = field(default_factory=list)
    builtin_args: list[str] = field(default_factory=list)
    threads: int | None = None
    provider: str = "auto"
    oracle_acceptance: list[float] = field(default_factory=lambda: [0.8])
    oracle_delay_ms: float = 0.0
    # the oracle's delay per token as fractions of the measured plain step (a sweep);
    # replaces oracle_delay_ms when given
    oracle_delay_steps: list[float] | None = None
    oracle_seed: int = 0
    # the oracle's ready drafts after a share of misses (OracleConfig.runner_up_hits)
    oracle_runner_up_hits: list[float] = field(default_factory=lambda: [0.0])
    # a mode kind listed here runs at these k instead of -k (the sweep: -k plus these)
    mode_ks: dict[str, list[int]] = field(default_factory=dict)
    ceiling_ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])  # t_v(k)
    ceiling_repeats: int = 8  # timed rounds per k (after 2 untimed)
    llama_server: Path | None = None
    work_dir: Path | None = None  # logs and oracle folders (default: a temp dir)
    startup_timeout: float = 600.0
    request_timeout: float = 1800.0
    time_budget_s: float | None = None  # start no new mode after this long
    exact_check: str = "first"  # non-streamed token check: "first" repeat, "all", "none"
    # each mode's warm-up: "context" (a prompt outside the set at the same context, as
    # long as the measured ones) or "short" (WARMUP_TEXT, WARMUP_TOKENS)
    warmup: str = "context"
    # proxy and oracle run once per variant: (name, extra `npu-spec serve` options)
    proxy_variants: list[tuple[str, list[str]]] = field(default_factory=lambda: [("", [])])
    # the variants the proxy mode (the real drafter) and the oracle run; None: all of them
    proxy_mode_variants: list[str] | None = None
    oracle_mode_variants: list[str] | None = None
    # turns per conversation: each turn's prompt is the last turn's prompt, the plain
    # answer and a follow-up question (a chat user's slots), answered in order
    turns: int = 1
    regime: str | None = None  # the regime server's regime (llama_server is its launcher)
    # near-tie branches the oracle may follow, per reference (the smallest gaps; 0: none),
    # and the top-2 logit gap under which a position counts (see proxy.bench.branches)
    oracle_branches: int = DEFAULT_BRANCHES
    oracle_sub_branches: int = 0  # per branch, its own near-tie branches
    branch_margin: float = NEAR_TIE_LOGIT_GAP


@dataclass(frozen=True)
class PlainOutput:
    """What plain llama-server wrote for one prompt: the exact ids (non-streamed) and
    what its stream carried (ids and text), to compare streamed runs against."""

    tokens: list[int]
    stream_tokens: list[int]
    text: str
    branches: tuple[Branch, ...] = ()  # after near-ties' runners-up (proxy.bench.branches)


@dataclass
class Trial:
    """What every mode of one (context, repeat) shares."""

    context: int | None
    repeat: int
    prompts: list[BenchPrompt]
    outputs: dict[str, PlainOutput]  # by prompt id
    config: ServeConfig
    oracle_folders: dict[tuple[float, float, float], Path]  # (acceptance, delay ms, hits)
    oracle_delays: list[tuple[float | None, float]]  # (X or None, delay ms)


def oracle_delays(
    options: BenchOptions, plain_ms: float | None
) -> list[tuple[float | None, float]]:
    """(X, ms) per oracle delay: X times the measured plain step, or the fixed ms."""
    if options.oracle_delay_steps is None:
        return [(None, options.oracle_delay_ms)]
    if plain_ms is None:
        raise RuntimeError("--oracle-delay-steps needs the plain step, which was not measured")
    return [(x, x * plain_ms) for x in options.oracle_delay_steps]


def mode_units(specs: list[ModeSpec]) -> list[ModeSpec | list[ModeSpec]]:
    """plain and builtin alone; proxy and oracle modes together (they share a server)."""
    alone: list[ModeSpec | list[ModeSpec]] = [s for s in specs if not s.speculative]
    shared = [s for s in specs if s.speculative]
    return alone + ([shared] if shared else [])


def mode_specs(
    options: BenchOptions, k: int, with_plain: bool = True,
    delays: list[tuple[float | None, float]] | None = None,
) -> list[ModeSpec]:  # fmt: skip
    """The modes of one k group; plain does not depend on k, so it runs in one group.
    builtin-synth runs once per oracle acceptance, the oracle once per acceptance,
    delay and proxy variant."""
    if delays is None:
        delays = oracle_delays(options, None) if options.oracle_delay_steps is None else []
    specs = []
    for kind in options.modes:
        if kind == "plain" and not with_plain:
            continue
        if options.mode_ks and kind != "plain" and k not in options.mode_ks.get(kind, options.ks):
            continue
        if kind == "oracle":
            specs += [
                ModeSpec("oracle", k, acceptance=a, delay_ms=ms, delay_steps=x,
                         runner_up_hits=h, variant=name, serve_args=tuple(args))
                for a in options.oracle_acceptance
                for x, ms in delays
                for h in options.oracle_runner_up_hits
                for name, args in options.proxy_variants
                if options.oracle_mode_variants is None or name in options.oracle_mode_variants
            ]  # fmt: skip
        elif kind == "builtin-synth":
            specs += [ModeSpec(kind, k, acceptance=a) for a in options.oracle_acceptance]
        elif kind == "proxy":
            wanted = options.proxy_mode_variants
            specs += [
                ModeSpec("proxy", k, variant=name, serve_args=tuple(args))
                for name, args in options.proxy_variants
                if wanted is None or name in wanted
            ]
        else:
            specs.append(ModeSpec(kind, 0 if kind == "plain" else k))
    return specs


def sweep_ks(options: BenchOptions) -> list[int]:
    """Every k some mode runs at: -k, then the --mode-k values in order of appearance."""
    ks = list(dict.fromkeys(options.ks))
    for values in options.mode_ks.values():
        ks += [k for k in values if k not in ks]
    return ks


def rotated(items: list[T], shift: int) -> list[T]:
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def slot_context(prompts: list[BenchPrompt], n_predict: int) -> int:
    """Per-slot context every server gets: the longest prompt plus the generation."""
    longest = max(len(p.tokens) for p in prompts)
    return -(-(longest + n_predict + 64) // 256) * 256


FOLLOW_UPS = (
    "Go on, in more detail, with an example.",
    "Now list the main points of your answer, one line each.",
    "What would you change if you did it again, and why?",
)


def follow_up(index: int) -> str:
    """The user's next message after an answer, in the Qwen chat format (the answer is
    closed first: a turn cut at n_predict has no end token of its own)."""
    text = FOLLOW_UPS[index % len(FOLLOW_UPS)]
    return f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


class BenchSession:
    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.binary = find_llama_server(options.llama_server)
        self.work_dir = Path(options.work_dir or tempfile.mkdtemp(prefix="npu-spec-bench-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict[str, Any]] = []
        self.instances: list[dict[str, Any]] = []
        self.references: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.round_costs: dict[str, dict[str, Any]] = {}  # by str(context)
        self._started = now_utc()
        self._progress: Path | None = None  # where `run` writes the result so far
        self._deadline: float | None = None  # time.monotonic() when --time-budget-s is spent
        self.host = host_info(self.binary)
        # the warm-up request's prompt and length (see BenchOptions.warmup)
        self._warmup: tuple[list[int], int, str] = ([], WARMUP_TOKENS, "short")
        # the warm-up prompt's plain greedy output: the oracle drafts for it as well, so
        # that its warm-up teaches the proxy what a real drafter's would
        self._warmup_output: list[int] = []
        self._warmup_branches: tuple[Branch, ...] = ()

    def _config(self, ctx: int) -> ServeConfig:
        o = self.options
        return ServeConfig(
            llama_server=self.binary,
            target=o.target,
            draft_gguf=o.draft_gguf,
            drafter=o.drafter,
            ctx=ctx,
            threads=o.threads,
            server_args=list(o.server_args),
            builtin_args=list(o.builtin_args),
            provider=o.provider,
            log_dir=self.work_dir / "logs",
            startup_timeout=o.startup_timeout,
        )

    async def _reference_phase(
        self, session: aiohttp.ClientSession, context: int | None
    ) -> tuple[list[BenchPrompt], dict[str, PlainOutput]]:
        """Build the token prompts and record plain greedy output for each."""
        o = self.options
        prompt_set = load_prompt_set(o.prompts_path)
        guess = max(context or 0, int(prompt_set.get("long", {}).get("target_tokens", 0)), 1024)
        args = ["-c", str(-(-(2 * guess + o.n_predict) // 256) * 256), "-np", "1"]
        args += (["-t", str(o.threads)] if o.threads else []) + list(o.server_args)
        log_path = self.work_dir / "logs" / f"reference-ctx{context}.log"
        server = LlamaServerProcess(self.binary, o.target, args, log_path=log_path)
        await server.start(o.startup_timeout)
        try:
            text = ServerText(session, server.base_url)
            every = await build_prompts(text, prompt_set, context)
            prompts = select(every, o.prompt_ids)
            outputs: dict[str, PlainOutput] = {}
            turns: list[BenchPrompt] = []
            for prompt in prompts:
                turn = prompt
                for index in range(o.turns):
                    exact = await exact_tokens(session, server.base_url, turn.tokens, o.n_predict)
                    done = await stream_completion(
                        session, server.base_url, turn.tokens, o.n_predict
                    )
                    branches, points = await self._branches(session, server, context, turn, exact)
                    outputs[turn.id] = PlainOutput(exact, done.tokens, done.text, branches)
                    turns.append(turn)
                    self.references.append(
                        {"context": context, "prompt": turn.id, "kind": turn.kind,
                         "n_prompt": len(turn.tokens), "n_generated": len(exact),
                         "n_stream_tokens": len(done.tokens),
                         "branches": [
                             {"position": p.position, "runner_up": p.runner_up, "gap": p.gap,
                              "n_generated": len(b.continuation),
                              **({} if p.within is None else {"within": p.within})}
                             for p, b in zip(points, branches, strict=True)
                         ]}
                    )  # fmt: skip
                    if index + 1 < o.turns:
                        follow = await text.tokenize(follow_up(index), add_special=False)
                        turn = BenchPrompt(
                            f"{prompt.id}/t{index + 2}", turn.kind, (*turn.tokens, *exact, *follow)
                        )
            prompts = turns
            # as long as the measured prompts at most: the slots are sized for those
            longest = max(len(p.tokens) for p in prompts)
            outside = [p for p in every if p not in prompts and len(p.tokens) <= longest]
            if o.warmup == "context" and outside:
                self._warmup = (list(outside[0].tokens), o.n_predict, outside[0].id)
            else:
                self._warmup = (await text.tokenize(WARMUP_TEXT), WARMUP_TOKENS, "short")
            warm_tokens, warm_n, warm_id = self._warmup
            self._warmup_output = await exact_tokens(session, server.base_url, warm_tokens, warm_n)
            # the oracle follows the warm-up's near-ties too: off its path, the warm-up
            # drafts nothing and the proxy learns nothing there (H200, 4k: 7 drafts in
            # 107 rounds, docs/BENCHMARKS.md)
            if warm_n == o.n_predict:  # a prompt of the set (`--warmup context`)
                warm_turn = BenchPrompt(warm_id, "warmup", tuple(warm_tokens))
                self._warmup_branches, _ = await self._branches(
                    session, server, context, warm_turn, self._warmup_output
                )
        finally:
            await server.stop()
        return prompts, outputs

    async def _branches(
        self, session: aiohttp.ClientSession, server: LlamaServerProcess, context: int | None,
        turn: BenchPrompt, exact: list[int],
    ) -> tuple[tuple[Branch, ...], list[BranchPoint]]:  # fmt: skip
        """The near-tie branches of one reference, for the oracle (none without oracle
        modes, or against the regime server: its scripted target has no near-ties and no
        n_probs). A failure is recorded; the oracle then has the reference alone."""
        o = self.options
        if "oracle" not in o.modes or o.oracle_branches <= 0 or o.regime is not None:
            return (), []
        try:
            branches, points = await record_branches(
                session, server.base_url, turn.tokens, exact, o.n_predict, o.branch_margin,
                o.oracle_branches, o.oracle_sub_branches,
            )  # fmt: skip
        except (aiohttp.ClientError, RuntimeError, KeyError, TypeError) as exc:
            log.exception("ctx %s: recording the branches of %s failed", context, turn.id)
            self.errors.append(
                {"mode": "branches", "k": 0, "context": context, "repeat": 0,
                 "prompt": turn.id, "error": f"{type(exc).__name__}: {exc}"}
            )  # fmt: skip
            return (), []
        return tuple(branches), points

    def _oracle_folders(
        self, context: int | None, prompts: list[BenchPrompt], outputs: dict[str, PlainOutput],
        delays: list[tuple[float | None, float]],
    ) -> dict[tuple[float, float, float], Path]:  # fmt: skip
        o = self.options
        if "oracle" not in o.modes:
            return {}
        references: list[RecordedReference] = [
            (p.tokens, outputs[p.id].tokens, outputs[p.id].branches) for p in prompts
        ]
        references.append(
            (tuple(self._warmup[0]), tuple(self._warmup_output), self._warmup_branches)
        )
        folders = {}
        for a in o.oracle_acceptance:
            for _, ms in delays:
                for h in o.oracle_runner_up_hits:
                    config = OracleConfig(
                        acceptance=a, delay_ms=ms, seed=o.oracle_seed, runner_up_hits=h
                    )
                    folder = self.work_dir / f"oracle-ctx{context}-a{a:g}-d{ms:.4g}-ru{h:g}"
                    folders[(a, ms, h)] = write_oracle_folder(folder, references, config)
        return folders

    async def _cost_phase(self, context: int | None, prompts: list[BenchPrompt]) -> RoundCosts:
        """The plain step and t_v(k) at the measured prompts' length, on a managed-mode
        server: the context, or with several turns (or no context) the median turn's
        prompt. A chat's later turns run at 2-3 times the first's context, where each
        round reads more KV; priced at the first's, the Strix Halo 32B chats' ceiling
        came out too high."""
        o = self.options
        lengths = sorted(len(p.tokens) for p in prompts)
        median = lengths[len(lengths) // 2]
        length = median if o.turns > 1 or not context else context
        log.info("ctx %s: measuring the plain step and t_v(k) for k in %s", context, o.ceiling_ks)
        costs = await measure_round_costs(
            o.target, length, o.ceiling_ks, server_args=o.server_args, threads=o.threads,
            llama_server=self.binary, work_dir=self.work_dir / f"round-costs-ctx{context}",
            repeats=o.ceiling_repeats, startup_timeout=o.startup_timeout,
        )  # fmt: skip
        self.round_costs[str(context)] = costs.to_dict()
        return costs

    async def _run_mode(
        self, session: aiohttp.ClientSession, trial: Trial, spec: ModeSpec,
        verify_server: VerifyServer | None = None,
    ) -> None:  # fmt: skip
        o = self.options
        log_name = _log_name(trial, spec)
        folder = (
            trial.oracle_folders.get((spec.acceptance, spec.delay_ms, spec.runner_up_hits))
            if spec.kind == "oracle" and spec.acceptance is not None
            else None
        )
        instance = make_instance(trial.config, spec, log_name, verify_server, folder)
        log.info("ctx %s k %d repeat %d: %s", trial.context, spec.k, trial.repeat, spec.name)
        if verify_server is not None:
            await verify_server.erase_slots(session)
        await instance.start()
        # llama.cpp's drafter timer (builtin modes): cumulative, read after each request
        drafter = (
            instance
            if isinstance(instance, LlamaServerMode) and spec.kind in BUILTIN_KINDS
            else None
        )
        try:
            warm_tokens, warm_n, warm_id = self._warmup
            warm = await stream_completion(session, instance.base_url, warm_tokens, warm_n)
            warmup = {
                "prompt": warm_id,
                "n_prompt": len(warm_tokens),
                "n_generated": warm.n_predicted,
                "tokens_per_s": warm.tokens_per_s,
            }
            seen = await drafter.draft_stats() if drafter else None
            if seen is None:  # no statistics in the log: no drafter timer for this mode
                drafter = None
            for prompt in trial.prompts:
                done = await stream_completion(
                    session, instance.base_url, prompt.tokens, o.n_predict, instance.metrics_url,
                    round_counter=ROUND_COUNTER if spec.speculative else None,
                )  # fmt: skip
                draft_timer = None
                if drafter:
                    now = await drafter.draft_stats(seen)
                    draft_timer = _draft_timer(now, seen)
                    seen = now
                exact = None
                check = o.exact_check == "all" or (o.exact_check == "first" and trial.repeat == 0)
                if check and spec.valid_output:
                    exact = await exact_tokens(
                        session, instance.base_url, prompt.tokens, o.n_predict
                    )
                    if drafter:
                        seen = await drafter.draft_stats(seen)
                record = self._run_record(spec, trial, prompt, done, exact)
                if draft_timer is not None:
                    record["stats"].update(draft_timer)
                if exact is not None and record["first_mismatch"] is not None:
                    # the verify server (proxy, oracle) or the mode's own server
                    probe = verify_server.base_url if verify_server else instance.base_url
                    reference = trial.outputs[prompt.id].tokens
                    record["near_tie"] = await _near_tie(
                        session, probe, prompt, reference, exact, record["first_mismatch"]
                    )
                self.runs.append(record)
            memory = instance.memory()
        finally:
            await instance.stop()
        self.instances.append(
            {"mode": spec.name, "kind": spec.kind, "k": spec.k, "context": trial.context,
             "repeat": trial.repeat, "memory": memory, "warmup": warmup}
        )  # fmt: skip

    async def _run_unit(
        self, session: aiohttp.ClientSession, trial: Trial, unit: ModeSpec | list[ModeSpec]
    ) -> None:
        """One mode alone, or the proxy/oracle modes of one k on their shared server.
        A failure is recorded and the session goes on with the other modes."""
        if isinstance(unit, ModeSpec):
            await self._guarded(self._run_mode(session, trial, unit), [unit], trial)
            return
        k = unit[0].k
        server = VerifyServer(trial.config, k, f"ctx{trial.context}-k{k}-r{trial.repeat}-verify")
        if not await self._guarded(server.start(), unit, trial):
            return
        try:
            # the budget and the progress file per mode: a shared server's unit holds
            # every proxy variant and oracle of one k, minutes of runs
            for spec in rotated(unit, trial.repeat):
                if self._out_of_time():
                    self._skip(spec, trial)
                    continue
                await self._guarded(self._run_mode(session, trial, spec, server), [spec], trial)
                self._save_progress()
        finally:
            await server.stop()

    def _skip(self, unit: ModeSpec | list[ModeSpec], trial: Trial) -> None:
        for spec in [unit] if isinstance(unit, ModeSpec) else unit:
            log.warning("time budget spent: skipping %s k %d repeat %d", spec.name, spec.k,
                        trial.repeat)  # fmt: skip
            self.errors.append(
                {"mode": spec.name, "k": spec.k, "context": trial.context,
                 "repeat": trial.repeat, "error": "skipped: --time-budget-s spent"}
            )  # fmt: skip

    async def _guarded(self, step: Awaitable[None], specs: list[ModeSpec], trial: Trial) -> bool:
        try:
            await step
            return True
        except (OSError, RuntimeError, ValueError, aiohttp.ClientError, TimeoutError) as exc:
            names = ", ".join(s.name for s in specs)
            log.exception("%s (ctx %s, repeat %d) failed", names, trial.context, trial.repeat)
            for spec in specs:
                self.errors.append(
                    {"mode": spec.name, "k": spec.k, "context": trial.context,
                     "repeat": trial.repeat, "error": f"{type(exc).__name__}: {exc}"}
                )  # fmt: skip
            return False

    def _run_record(
        self, spec: ModeSpec, trial: Trial, prompt: BenchPrompt, done: StreamedCompletion,
        exact: list[int] | None,
    ) -> dict[str, Any]:  # fmt: skip
        plain = trial.outputs[prompt.id]
        equal: bool | None
        if not spec.valid_output:  # synthetic acceptance: nothing to compare
            mismatch, equal = None, None
        elif exact is not None:  # token for token
            mismatch = first_mismatch(exact, plain.tokens)
            equal = mismatch is None
        else:  # what the stream shows: its ids and its text
            mismatch = first_mismatch(done.tokens, plain.stream_tokens)
            equal = mismatch is None and done.text == plain.text
        return {
            "mode": spec.name,
            "kind": spec.kind,
            "k": spec.k,
            "context": trial.context,
            "repeat": trial.repeat,
            "prompt": prompt.id,
            "n_prompt": len(prompt.tokens),
            "n_generated": done.n_predicted,
            "ttft_ms": done.ttft_ms,
            "first_n_ms": done.first_n_ms,
            "decode_ms": done.decode_ms,
            "total_ms": done.total_ms,
            "tokens_per_s": done.tokens_per_s,
            "e2e_tokens_per_s": done.e2e_tokens_per_s,
            "equal_to_plain": equal,
            "exact_checked": exact is not None,
            "first_mismatch": mismatch,
            "spec_header": done.spec_header,
            "server_timings": done.timings,
            "stats": request_stats(
                spec.kind,
                spec.k,
                done.n_predicted,
                done.metrics_before,
                done.metrics_first,
                done.metrics_after,
            ),
            "valid_output": spec.valid_output,
            "mode_params": {
                "acceptance": spec.acceptance,
                "delay_ms": spec.delay_ms,
                "delay_steps": spec.delay_steps,
                "runner_up_hits": spec.runner_up_hits,
            },
        }

    async def run(self, progress: Path | None = None) -> dict[str, Any]:
        """The whole session; with `progress`, the result so far is written there after
        every mode, so a session cut short still leaves its measurements."""
        o = self.options
        self._started = now_utc()
        self._progress = progress
        self._deadline = time.monotonic() + o.time_budget_s if o.time_budget_s else None
        timeout = aiohttp.ClientTimeout(total=None, sock_read=o.request_timeout)
        # A fresh connection per request: llama-server may close one after a stream.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for context in o.contexts:
                prompts, outputs = await self._reference_phase(session, context)
                config = self._config(slot_context(prompts, o.n_predict))
                delays = await self._delays(context, prompts)
                folders = self._oracle_folders(context, prompts, outputs, delays)
                # Repeats outermost, so drift spreads over every k as well as every mode.
                for repeat in range(o.repeats):
                    trial = Trial(context, repeat, prompts, outputs, config, folders, delays)
                    for k_index, k in enumerate(sweep_ks(o)):
                        specs = mode_specs(o, k, with_plain=k_index == 0, delays=delays)
                        units = mode_units(specs)
                        for unit in rotated(units, repeat + k_index):
                            if self._out_of_time():
                                self._skip(unit, trial)
                                continue
                            await self._run_unit(session, trial, unit)
                            self._save_progress()
        return self.result(finished=True)

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def _save_progress(self) -> None:
        """The result so far, where `run` was given a progress file."""
        if self._progress is not None:
            write_json(self.result(finished=False), self._progress)

    async def _delays(
        self, context: int | None, prompts: list[BenchPrompt]
    ) -> list[tuple[float | None, float]]:
        """Measure this context's round costs (unless --ceiling-ks is empty) and turn
        --oracle-delay-steps into ms. A failed measurement is recorded; the session
        goes on without ceilings (and without X-delayed oracles)."""
        o = self.options
        plain_ms = None
        if o.ceiling_ks:
            try:
                plain_ms = (await self._cost_phase(context, prompts)).plain_ms
            except (OSError, RuntimeError, ValueError, aiohttp.ClientError, TimeoutError) as exc:
                log.exception("ctx %s: measuring round costs failed", context)
                error = f"{type(exc).__name__}: {exc}"
                self.errors.append(
                    {"mode": "round-costs", "k": 0, "context": context, "repeat": 0,
                     "error": error}
                )  # fmt: skip
        if o.oracle_delay_steps is not None and plain_ms is None:
            return []  # no oracle modes: their delay is unknown
        return oracle_delays(o, plain_ms)

    def result(self, finished: bool) -> dict[str, Any]:
        o = self.options
        return {
            "schema": SCHEMA,
            "started_utc": self._started,
            "finished_utc": now_utc() if finished else None,
            "host": self.host,
            "options": jsonable(asdict(o)),
            "work_dir": str(self.work_dir),
            "references": self.references,
            "round_costs": self.round_costs,
            "summary": summary_rows(self.runs, self.instances, self.round_costs, o.draft_shape),
            "instances": self.instances,
            "runs": self.runs,
            "errors": self.errors,
        }


def _log_name(trial: Trial, spec: ModeSpec) -> str:
    """The name of a mode's server log in one trial."""
    name = f"ctx{trial.context}-k{spec.k}-r{trial.repeat}-{spec.kind}"
    if spec.acceptance is not None:
        name += f"-a{spec.acceptance:g}"
    if spec.delay_steps is not None:
        name += f"-X{spec.delay_steps:g}"
    if spec.runner_up_hits:
        name += f"-ru{spec.runner_up_hits:g}"
    if spec.variant:
        name += f"-{spec.variant}"
    return name


async def _near_tie(
    session: aiohttp.ClientSession, probe: str, prompt: BenchPrompt, reference: list[int],
    exact: list[int], mismatch: int,
) -> dict[str, Any]:  # fmt: skip
    """Whether an output's first difference from the reference is a near-tie, as the
    server at `probe` shows it; an error is recorded rather than ending the session."""
    try:
        return await explain_mismatch(session, probe, prompt.tokens, reference, exact, mismatch)
    except (aiohttp.ClientError, RuntimeError, KeyError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _draft_timer(now: DraftStats | None, before: DraftStats | None) -> dict[str, float] | None:
    """One request's share of llama.cpp's cumulative drafter statistics."""
    if now is None:
        return None
    base = before or DraftStats(0, 0, 0.0)
    return {"draft_timer_ms": now.ms - base.ms, "draft_timer_tokens": now.tokens - base.tokens}


async def run_bench(options: BenchOptions, progress: Path | None = None) -> dict[str, Any]:
    return await BenchSession(options).run(progress)
