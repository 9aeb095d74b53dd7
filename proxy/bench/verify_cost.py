"""What one verification round costs on the server, and why (a microbenchmark).

For each server option set (`--variant NAME=ARGS`) and each prompt length, one
llama-server is started with exactly the flags managed mode uses
(`proxy.server.managed.verification_flags`: -kvu, --no-cache-idle-slots, -cram 0,
--metrics, one -c share per slot) and measured with real requests on random token
ids (the cost of a pass does not depend on which tokens it sees):

- a: plain decoding in the server's own loop: `timings.predicted_per_token_ms` of
  one /completion generating `--plain-tokens` tokens after a cached prompt;
- b: one /completion with 1 new token on a cached prompt, n_predict 1: the HTTP
  round trip of the cheapest possible request;
- c: one slot ingesting m new tokens and predicting 1 (what llama.cpp's built-in
  verifier feeds per round: k drafts + 1);
- d: the proxy's verify round: k+1 prompts in one request, in the steady state
  the proxy sees. Slot i holds ctx + the previous round's drafts d1..di; the
  round's prompts are ctx' + e1..ei with ctx' = ctx + d1..dj + correction
  (j = k // 2 accepted). The idle slots are empty;
- e: the same round with the KV cache shaped differently: the big server with every
  idle slot holding a stale context of the same length (unified KV: every query may
  attend over all cells; for every k), and a server with only -np k+1 slots (for
  each k of `--np-ks`);
- f: a cold start's parts: one slot prefilling the whole context (fresh token ids,
  the server's prompt_ms), saving it and restoring it into another slot (each
  action's wall ms and the server's own save_ms / restore_ms). The regime server's
  files take their prefill and copy costs from this row;
- h: part d's round after each number j = 0..k of the previous round's drafts was
  accepted (d takes j = k // 2 only): a round catches up on the j accepted tokens in
  every slot that held fewer, so it ingests (k+1)(k+2)/2 + j(j+1)/2 tokens, and on
  Vulkan the larger j cross the 8-token matrix-vector edge. The bench's ceilings weight
  these by the chance of each j (`proxy.bench.costmodel.expected_round_ms`);
- g: the same with every other slot holding a stale context of the same length, as
  when a new request comes after earlier ones filled the slots: with unified KV the
  prefill's queries may attend over every cell of the pool, and a save or restore
  works over the whole pool. Against f it gives the cost per cell of the pool's span
  of a 512-token micro-batch and of the slot actions;
- m: part h's rounds with the number accepted changing every round (j = 0, 1, .., k in
  turn), as a generation's rounds do: a batch of another shape than the last one makes
  llama.cpp build its compute graph anew, where h's rows repeat one shape and reuse it;
- i: on a plain server (the bench's plain mode: -np 1, the RAM prompt cache on, as
  llama-server runs by default), a fresh prompt of the context's length while the slot
  holds another, against the same on an emptied slot: before it prefills, the server
  copies the slot's old prompt into its RAM prompt cache. The regime files charge
  that copy per token (`prompt_cache_save_ms_per_ktoken`).

Every timed request is bracketed by /metrics reads, so each row says how many
llama_decode calls a round took (must be 1) and how many prompt tokens the server
ingested; the server's own `timings.prompt_ms` (+ predicted_ms) splits server
compute from HTTP, JSON and task overhead. Medians and p10-p90 over `--repeats`
timed rounds after `--warmup` untimed ones.

One server per (variant, context) serves a-f and e's "idle slots full" rows; e's
"-np k+1" row needs one more small server per k in `--np-ks`. Slots are filled
by prefilling one slot and restoring its saved state into the others, as the
proxy does at cold start.

    python scripts/verify_cost.py --models /tmp/m14 --context 512,4k \\
      --variant 'base=-ngl 99 -fa on' --variant 'fa-off=-ngl 99 -fa off' \\
      --variant 'ub64=-ngl 99 -fa on -ub 64' -o verify-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.host import host_info
from proxy.bench.options import Variant, comma_choices, context_list, int_list, parse_variant
from proxy.bench.results import default_result_path, jsonable, now_utc, write_json
from proxy.engine.round_shape import round_tokens
from proxy.server.llama_server import LlamaServerProcess, find_llama_server
from proxy.server.managed import ServerLayout, managed_server
from proxy.server.upstream import (
    GREEDY_VERIFY_PARAMS,
    VERIFY_FIELDS,
    UpstreamClient,
    UpstreamClientError,
    UpstreamError,
)

log = logging.getLogger(__name__)

SCHEMA = "npu-spec-verify-cost/1"
PARTS = ("a", "b", "c", "d", "e", "f", "g", "h", "m", "i")
DECODES = "llamacpp:n_decode_total"
PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
CACHED_TOKENS = "llamacpp:prompt_tokens_cached_total"


@dataclass
class VerifyCostOptions:
    target: Path
    variants: list[Variant] = field(default_factory=lambda: [Variant("default", [])])
    contexts: list[int] = field(default_factory=lambda: [512])
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 6, 8])
    new_tokens: list[int] = field(default_factory=lambda: [1, 3, 5, 7, 9])  # c's m
    np_large: int = 9  # slots of the main server (at least max k + 1)
    np_ks: list[int] = field(default_factory=lambda: [4])  # e: -np k+1 vs np_large
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    repeats: int = 10
    warmup: int = 2
    plain_tokens: int = 64
    threads: int | None = None
    seed: int = 0
    llama_server: Path | None = None
    work_dir: Path | None = None
    startup_timeout: float = 600.0

    @property
    def main_slots(self) -> int:
        return max([self.np_large, *(k + 1 for k in self.ks)])


# -- statistics -------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's numbers from its timed samples (`Bench._timed`, or `Bench.plain`'s)."""
    ms = [s["ms"] for s in samples]
    timed = [s for s in samples if "client_json_ms" in s]  # one request each (b-e)
    server = [s["server_ms"] for s in samples if s.get("server_ms") is not None]
    decodes = [s["decodes"] for s in samples]
    return {
        "n": len(samples),
        "ms_median": _median(ms),
        "ms_p10": percentile(ms, 0.1),
        "ms_p90": percentile(ms, 0.9),
        "server_ms_median": _median(server),
        # everything that is not the server's own pass: HTTP, JSON, tokens, task queue
        "overhead_ms_median": _median(
            [s["ms"] - s["server_ms"] for s in timed if s["server_ms"] is not None]
        ),
        "client_json_ms_median": _median([s["client_json_ms"] for s in timed]),
        "decodes_per_round": statistics.fmean(decodes) if decodes else None,
        "decodes_min": min(decodes) if decodes else None,
        "decodes_max": max(decodes) if decodes else None,
        "tokens_per_round": _median([s["tokens"] for s in samples]),
    }


# -- one server's measurements ------------------------------------------------------


class Bench:
    """Requests against one running server; every method leaves a row of samples."""

    def __init__(self, client: UpstreamClient, options: VerifyCostOptions, seed: int) -> None:
        self.client = client
        self.options = options
        self.rng = random.Random(seed)
        self.n_vocab = 32000
        self.saved: set[str] = set()  # slot files this server has written

    async def setup(self) -> None:
        models = await self.client.models()
        meta = (models.get("data") or [{}])[0].get("meta") or {}
        self.n_vocab = int(meta.get("n_vocab") or self.n_vocab)

    def tokens(self, n: int) -> list[int]:
        # ordinary ids: skip the low bytes and the special tokens at the top
        high = max(200, int(self.n_vocab * 0.95))
        return [self.rng.randrange(100, high) for _ in range(n)]

    async def counters(self) -> dict[str, float]:
        return await self.client.metrics()

    async def erase_all(self, slots: int) -> None:
        for slot in range(slots):
            await self.client.slot_action(slot, "erase", "")

    async def prefill(self, slot: int, tokens: list[int]) -> None:
        await self.client.completion(
            {"prompt": tokens, "id_slot": slot, **GREEDY_VERIFY_PARAMS, "response_fields": []}
        )

    async def fill(self, slots: Sequence[int], tokens: list[int], filename: str) -> None:
        """Every slot in `slots` holds `tokens` (and only them): one prefill, saved once,
        restored into the rest, as the proxy does at cold start. `filename` names
        `tokens` for this server: the same name must always mean the same tokens."""
        todo = list(slots)
        if not todo:
            return
        if filename not in self.saved:
            first = todo.pop(0)
            await self.prefill(first, tokens)
            try:
                await self.client.slot_action(first, "save", filename)
                self.saved.add(filename)
            except (UpstreamError, UpstreamClientError) as exc:
                log.warning("slot save failed (%s); prefilling each slot", exc)
        for slot in todo:
            if filename in self.saved:
                await self.client.slot_action(slot, "restore", filename)
            else:
                await self.prefill(slot, tokens)

    async def _timed(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request between two /metrics reads: wall ms, server ms, decodes, tokens."""
        client_json_ms = _json_ms(body)
        before = await self.counters()
        start = time.perf_counter()
        payload = await self.client.completion(body)
        wall = (time.perf_counter() - start) * 1e3
        after = await self.counters()
        results = payload if isinstance(payload, list) else [payload]
        server = [
            float(r.get("timings/prompt_ms", 0.0)) + float(r.get("timings/predicted_ms", 0.0))
            for r in results
        ]
        return {
            "ms": wall,
            "server_ms": max(server) if server else None,
            "client_json_ms": client_json_ms,
            "decodes": round(after.get(DECODES, 0) - before.get(DECODES, 0)),
            "tokens": round(after.get(PROMPT_TOKENS, 0) - before.get(PROMPT_TOKENS, 0)),
            "cached": round(after.get(CACHED_TOKENS, 0) - before.get(CACHED_TOKENS, 0)),
            "results": [
                {
                    "index": r.get("index", 0),
                    "id_slot": r.get("id_slot"),
                    "prompt_n": r.get("timings/prompt_n"),
                    "cache_n": r.get("timings/cache_n"),
                    "prompt_ms": r.get("timings/prompt_ms"),
                }
                for r in sorted(results, key=lambda r: r.get("index", 0))
            ],
        }

    async def plain(self, ctx: list[int]) -> list[dict[str, Any]]:
        """a: decoding in the server's own loop after the (cached) prompt `ctx`."""
        n = self.options.plain_tokens
        body = {
            "prompt": ctx,
            **GREEDY_VERIFY_PARAMS,
            "n_predict": n,
            "ignore_eos": True,
            "response_fields": ["timings"],
        }
        samples = []
        for i in range(self.options.warmup + self.options.repeats):
            before = await self.counters()
            start = time.perf_counter()
            payload = await self.client.completion(body)
            wall = (time.perf_counter() - start) * 1e3
            after = await self.counters()
            timings = payload.get("timings", {})
            predicted = max(int(timings.get("predicted_n", n)), 1)
            per_token = float(timings.get("predicted_per_token_ms", 0.0))
            if i < self.options.warmup:
                continue
            samples.append(
                {
                    "ms": per_token,
                    "server_ms": per_token,
                    "wall_ms": wall,
                    "predicted_n": predicted,
                    "decodes": (after.get(DECODES, 0) - before.get(DECODES, 0)) / predicted,
                    "tokens": 1,
                    "prompt_tokens": round(
                        after.get(PROMPT_TOKENS, 0) - before.get(PROMPT_TOKENS, 0)
                    ),
                }
            )
        return samples

    async def copies(
        self, context: int, slots: int, stale: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """f: cold prefill of `context` fresh tokens in slot 0 (every slot empty), save,
        restore into slot 1; g (`stale`): every slot but 0 holds `stale` first."""
        samples = []
        for i in range(self.options.warmup + self.options.repeats):
            await self.erase_all(slots)
            if stale is not None:
                await self.fill(list(range(1, slots)), stale, "stale.bin")
            body = {
                "prompt": self.tokens(context), "id_slot": 0, **GREEDY_VERIFY_PARAMS,
                "response_fields": VERIFY_FIELDS,
            }  # fmt: skip
            sample = await self._timed(body)
            start = time.perf_counter()
            saved = await self.client.slot_action(0, "save", "copy.bin")
            save_wall = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            restored = await self.client.slot_action(1, "restore", "copy.bin")
            restore_wall = (time.perf_counter() - start) * 1e3
            sample.update(
                save_wall_ms=save_wall,
                restore_wall_ms=restore_wall,
                save_ms=float((saved.get("timings") or {}).get("save_ms", 0.0)),
                restore_ms=float((restored.get("timings") or {}).get("restore_ms", 0.0)),
                n_saved=int(saved.get("n_saved", 0)),
            )
            if i >= self.options.warmup:
                samples.append(sample)
        return samples

    async def prompt_switch(self, context: int) -> list[dict[str, Any]]:
        """i (a plain server: one slot, the RAM prompt cache on): a fresh prompt of
        `context` tokens on an emptied slot, then another while the slot holds the
        first; `save_ms` is what the second took beyond the first outside the server's
        prompt and predict timings (the server copied the first prompt into its prompt
        cache before prefilling)."""
        samples = []
        for i in range(self.options.warmup + self.options.repeats):
            await self.erase_all(1)
            bodies = [
                {"prompt": self.tokens(context), **GREEDY_VERIFY_PARAMS,
                 "response_fields": VERIFY_FIELDS}
                for _ in range(2)
            ]  # fmt: skip
            cold = await self._timed(bodies[0])
            sample = await self._timed(bodies[1])
            # outside the server's own prompt timing, which starts after the copy: the
            # prefills' jitter stays out of it
            outside = sample["ms"] - (sample["server_ms"] or 0.0)
            cold_outside = cold["ms"] - (cold["server_ms"] or 0.0)
            sample.update(cold_ms=cold["ms"], save_ms=outside - cold_outside, n_saved=context)
            if i >= self.options.warmup:
                samples.append(sample)
        return samples

    async def one_slot(self, ctx: list[int], m: int) -> list[dict[str, Any]]:
        """b/c: the slot holding `ctx` gets m new tokens per request, n_predict 1."""
        prompt = list(ctx)
        samples = []
        for i in range(self.options.warmup + self.options.repeats):
            prompt += self.tokens(m)
            body = {"prompt": prompt, **GREEDY_VERIFY_PARAMS, "response_fields": VERIFY_FIELDS}
            sample = await self._timed(body)
            if i >= self.options.warmup:
                samples.append(sample)
        return samples

    async def rounds(
        self, ctx: list[int], k: int, j: int | None = None, turns: bool = False
    ) -> list[dict[str, Any]]:
        """d/e/h: steady-state verify rounds after j accepted (default k // 2); m
        (`turns`): after 0, 1, .., k accepted in turn. Slot i must already hold `ctx` for
        i <= k."""
        j = k // 2 if j is None else j
        drafts = self.tokens(k)
        # untimed: lay out the slots as a previous round leaves them (ctx + d1..di)
        await self.client.completion(_round_body(ctx, drafts))
        samples = []
        for i in range(self.options.warmup + self.options.repeats):
            j = i % (k + 1) if turns else j
            ctx = ctx + drafts[:j] + self.tokens(1)  # j accepted + the correction
            drafts = self.tokens(k)
            sample = await self._timed(_round_body(ctx, drafts))
            sample["accepted"] = j
            if i >= self.options.warmup:
                samples.append(sample)
        return samples


def _round_body(ctx: list[int], drafts: list[int]) -> dict[str, Any]:
    """Exactly the proxy's greedy verify request (UpstreamClient.verify), plus timings."""
    prompts = [ctx + drafts[:i] for i in range(len(drafts) + 1)]
    return {"prompt": prompts, **GREEDY_VERIFY_PARAMS, "response_fields": VERIFY_FIELDS}


def expected_round_tokens(k: int, j: int) -> int:
    """Prompt tokens a steady round must ingest after j of the previous k drafts were
    accepted. Every prompt shares ctx + d1..dj with the slots that held >= j drafts,
    so prompt i needs its correction and i new drafts: (k+1)(k+2)/2 in all; the j
    slots that held i < j drafts also miss d(i+1)..dj: j(j+1)/2 more. The total does
    not depend on which prompt lands in which slot (the engine's pad prompts rely on
    it: `proxy.engine.round_shape`)."""
    return round_tokens(k, j)


def _json_ms(body: dict[str, Any]) -> float:
    start = time.perf_counter()
    json.dumps(body)
    return (time.perf_counter() - start) * 1e3


# -- the session ------------------------------------------------------------------


def slot_ctx_needed(options: VerifyCostOptions, context: int) -> int:
    """Tokens one slot may reach in this session at `context` (before padding)."""
    rounds = options.warmup + options.repeats
    ks = sorted({*options.ks, *options.np_ks}) or [0]
    grow = [
        options.plain_tokens + 1,
        rounds * max([*options.new_tokens, 1]),
        *((rounds + 1) * (k // 2 + 1) + k + 1 for k in ks),
        *((rounds + 1) * (k + 1) + k + 1 for k in (ks if {"h", "m"} & set(options.parts) else [])),
    ]
    return context + max(grow) + 16


class Session:
    def __init__(self, options: VerifyCostOptions) -> None:
        self.options = options
        self.binary = find_llama_server(options.llama_server)
        self.work_dir = Path(options.work_dir or tempfile.mkdtemp(prefix="npu-spec-verify-cost-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.started = now_utc()
        self.host = host_info(self.binary)

    @contextlib.asynccontextmanager
    async def _serving(self, variant: Variant, context: int, slots: int, seed: int):
        """A Bench on a fresh server with `slots` slots, sized for this session at
        `context`, started with managed mode's flags plus the variant's; stopped and
        its slot files removed afterwards."""
        layout = ServerLayout(
            k=slots - 1,
            ctx_per_conversation=slot_ctx_needed(self.options, context),
            passthrough_slots=0,
        )
        name = f"{variant.name}-ctx{context}-np{slots}"
        slot_dir = self.work_dir / "slots" / name
        server = managed_server(
            self.options.target,
            layout,
            binary=self.binary,
            threads=self.options.threads,
            slot_save_dir=slot_dir,
            extra_args=variant.args,
            log_path=self.work_dir / "logs" / f"{name}.log",
        )
        self.servers.append(
            {"variant": variant.name, "context": context, "np": slots,
             "command": server.command, "log": str(server.log_path)}
        )  # fmt: skip
        try:
            await server.start(self.options.startup_timeout)
            async with UpstreamClient(server.base_url) as client:
                bench = Bench(client, self.options, seed)
                await bench.setup()
                yield bench
        finally:
            await server.stop()
            shutil.rmtree(slot_dir, ignore_errors=True)  # up to a GB per slot file

    def _row(
        self, variant: Variant, context: int, part: str, what: str, np: int,
        samples: list[dict[str, Any]], **extra: Any,
    ) -> None:  # fmt: skip
        if "k" in extra and part != "m":  # a verify round: what it must ingest at j (d, e: k // 2)
            j = extra.get("accepted", extra["k"] // 2)
            extra["expected_tokens"] = expected_round_tokens(extra["k"], j)
        row = {"variant": variant.name, "context": context, "part": part, "what": what,
               "np": np, **extra, **summarize(samples), "samples": samples}  # fmt: skip
        self.rows.append(row)
        log.info(
            "%s ctx %d %s: %.2f ms, %.2f decodes, %s tokens", variant.name, context, what,
            row["ms_median"] or 0, row["decodes_per_round"] or 0, row["tokens_per_round"],
        )  # fmt: skip

    async def _main_server(self, variant: Variant, context: int, seed: int) -> None:
        o = self.options
        slots = o.main_slots
        async with self._serving(variant, context, slots, seed) as bench:
            ctx = bench.tokens(context)
            stale = bench.tokens(context)
            await bench.erase_all(slots)
            await bench.fill([0], ctx, "ctx.bin")
            if "a" in o.parts:
                samples = await bench.plain(ctx)
                self._row(variant, context, "a", "a: plain decoding, ms/token", slots, samples)
            ms = sorted({*([1] if "b" in o.parts else []),
                         *(o.new_tokens if "c" in o.parts else [])})  # fmt: skip
            for m in ms:
                await bench.erase_all(slots)
                await bench.fill([0], ctx, "ctx.bin")
                samples = await bench.one_slot(ctx, m)
                part, what = ("b", "b: 1 slot, +1 token") if m == 1 else (
                    "c", f"c: 1 slot, +{m} tokens")  # fmt: skip
                self._row(variant, context, part, what, slots, samples, m=m)
            for k in o.ks if "d" in o.parts else []:
                await bench.erase_all(slots)
                await bench.fill(list(range(k + 1)), ctx, "ctx.bin")
                samples = await bench.rounds(ctx, k)
                self._row(variant, context, "d", f"d: k={k}, k+1 prompts", slots, samples,
                          k=k, idle_slots="empty")  # fmt: skip
            for k in o.ks if "h" in o.parts else []:
                for j in range(k + 1):
                    await bench.erase_all(slots)
                    await bench.fill(list(range(k + 1)), ctx, "ctx.bin")
                    samples = await bench.rounds(ctx, k, j)
                    self._row(variant, context, "h", f"h: k={k}, after {j} accepted", slots,
                              samples, k=k, accepted=j, idle_slots="empty")  # fmt: skip
            for k in o.ks if "m" in o.parts else []:
                await bench.erase_all(slots)
                await bench.fill(list(range(k + 1)), ctx, "ctx.bin")
                samples = await bench.rounds(ctx, k, turns=True)
                self._row(variant, context, "m", f"m: k={k}, after 0..{k} accepted in turn",
                          slots, samples, k=k, idle_slots="empty")  # fmt: skip
            if "f" in o.parts:
                samples = await bench.copies(context, slots)
                self._row(variant, context, "f", "f: cold prefill, save, restore", slots, samples)
            if "g" in o.parts:
                samples = await bench.copies(context, slots, stale=stale)
                self._row(variant, context, "g", "g: f, other slots full", slots, samples,
                          idle_slots="full")  # fmt: skip
            for k in o.ks if "e" in o.parts else []:
                await bench.erase_all(slots)
                await bench.fill(list(range(k + 1, slots)), stale, "stale.bin")
                await bench.fill(list(range(k + 1)), ctx, "ctx.bin")
                samples = await bench.rounds(ctx, k)
                self._row(variant, context, "e", f"e: k={k}, -np {slots}, idle slots full",
                          slots, samples, k=k, idle_slots="full")  # fmt: skip

    async def _small_server(self, variant: Variant, context: int, k: int, seed: int) -> None:
        async with self._serving(variant, context, k + 1, seed) as bench:
            ctx = bench.tokens(context)
            await bench.fill(list(range(k + 1)), ctx, "ctx.bin")
            samples = await bench.rounds(ctx, k)
            self._row(variant, context, "e", f"e: k={k}, -np {k + 1}", k + 1, samples,
                      k=k, idle_slots="none")  # fmt: skip

    async def _plain_server(self, variant: Variant, context: int, seed: int) -> None:
        """i: a server with the bench's plain-mode flags (one slot, llama-server's own
        defaults otherwise, the RAM prompt cache among them) plus the variant's."""
        o = self.options
        name = f"{variant.name}-ctx{context}-plain"
        slot_dir = self.work_dir / "slots" / name  # only to empty the slot between samples
        slot_dir.mkdir(parents=True, exist_ok=True)
        args = ["-c", str(context + 64), "-np", "1", "--metrics", "--slot-save-path", str(slot_dir)]
        args += ["-t", str(o.threads)] if o.threads else []
        server = LlamaServerProcess(
            self.binary, o.target, [*args, *variant.args],
            log_path=self.work_dir / "logs" / f"{name}.log",
        )  # fmt: skip
        self.servers.append(
            {"variant": variant.name, "context": context, "np": 1,
             "command": server.command, "log": str(server.log_path)}
        )  # fmt: skip
        try:
            await server.start(o.startup_timeout)
            async with UpstreamClient(server.base_url) as client:
                bench = Bench(client, o, seed)
                await bench.setup()
                samples = await bench.prompt_switch(context)
                self._row(variant, context, "i", "i: plain server, a new prompt after another",
                          1, samples)  # fmt: skip
        finally:
            await server.stop()
            shutil.rmtree(slot_dir, ignore_errors=True)

    def _np_ks(self) -> list[int]:
        """e's k values: those with fewer slots than the main server."""
        if "e" not in self.options.parts:
            return []
        return [k for k in self.options.np_ks if k + 1 < self.options.main_slots]

    async def _guarded(self, variant: Variant, context: int, step) -> None:
        try:
            await step
        except (OSError, RuntimeError, ValueError, UpstreamError, UpstreamClientError,
                TimeoutError) as exc:  # fmt: skip
            log.exception("%s ctx %d failed", variant.name, context)
            self.errors.append({"variant": variant.name, "context": context,
                                "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip

    async def run(self, progress: Path | None = None) -> dict[str, Any]:
        o = self.options
        for variant in o.variants:
            for c_index, context in enumerate(o.contexts):
                seed = o.seed + c_index  # the same tokens for every variant
                if set(o.parts) - {"i"}:
                    await self._guarded(variant, context, self._main_server(variant, context, seed))
                for k in self._np_ks():
                    await self._guarded(
                        variant, context, self._small_server(variant, context, k, seed)
                    )
                if "i" in o.parts:
                    await self._guarded(
                        variant, context, self._plain_server(variant, context, seed)
                    )
                if progress is not None:
                    write_json(self.result(finished=False), progress)
        return self.result(finished=True)

    def result(self, finished: bool) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "started_utc": self.started,
            "finished_utc": now_utc() if finished else None,
            "host": self.host,
            "options": jsonable(asdict(self.options)),
            "work_dir": str(self.work_dir),
            "servers": self.servers,
            "rows": self.rows,
            "errors": self.errors,
        }


async def run_verify_cost(
    options: VerifyCostOptions, progress: Path | None = None
) -> dict[str, Any]:
    return await Session(options).run(progress)


@dataclass(frozen=True)
class RoundCosts:
    """What `npu-spec bench` needs from this microbenchmark at one context: the
    plain step (ms per token in the server's own loop) and the k+1-prompt round's
    wall ms by k (t_v(k), client side, as the proxy's verify_ms counts it): after
    k // 2 accepted (`round_ms`, part d's round) and after each j accepted
    (`round_ms_after`, part h: k -> j -> ms)."""

    context: int
    plain_ms: float | None
    round_ms: dict[int, float]
    result: dict[str, Any]  # the whole verify-cost result (servers, rows, errors)
    round_ms_after: dict[int, dict[int, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "plain_ms": self.plain_ms,
                "round_ms": {str(k): v for k, v in self.round_ms.items()},
                "round_ms_after": {str(k): {str(j): v for j, v in by_j.items()}
                                   for k, by_j in self.round_ms_after.items()},
                "verify_cost": self.result}  # fmt: skip


async def measure_round_costs(
    target: Path, context: int, ks: Sequence[int], *, server_args: Sequence[str] = (),
    threads: int | None = None, llama_server: Path | None = None, work_dir: Path | None = None,
    repeats: int = 8, warmup: int = 2, plain_tokens: int = 32, startup_timeout: float = 600.0,
) -> RoundCosts:  # fmt: skip
    """Parts a and h at one context on one server started as managed mode starts it
    (with `server_args`), with max(ks) + 1 slots; h's round after k // 2 accepted is
    part d's, so d is not measured again."""
    ks = sorted(set(ks))
    options = VerifyCostOptions(
        target=target, variants=[Variant("bench", list(server_args))], contexts=[context],
        ks=ks, new_tokens=[], np_large=max(ks) + 1, np_ks=[], parts=["a", "h"],
        repeats=repeats, warmup=warmup, plain_tokens=plain_tokens, threads=threads,
        llama_server=llama_server, work_dir=work_dir, startup_timeout=startup_timeout,
    )  # fmt: skip
    result = await run_verify_cost(options)
    if result["errors"]:
        raise RuntimeError(f"measuring round costs at {context}: {result['errors']}")
    plain = [r["ms_median"] for r in result["rows"] if r["part"] == "a"]
    after: dict[int, dict[int, float]] = {}
    for r in result["rows"]:
        if r["part"] == "h" and r["ms_median"]:
            after.setdefault(r["k"], {})[r["accepted"]] = r["ms_median"]
    rounds = {k: by_j[k // 2] for k, by_j in after.items() if k // 2 in by_j}
    return RoundCosts(context, plain[0] if plain else None, rounds, result, after)


# -- output -----------------------------------------------------------------------

TABLE_HEADER = (
    "variant", "ctx", "what", "np", "ms median", "p10-p90", "server ms", "other ms",
    "decodes/round", "tokens/round",
)  # fmt: skip


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_table(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for row in result["rows"]:
        cells = [
            row["variant"],
            str(row["context"]),
            row["what"],
            str(row["np"]),
            _f(row["ms_median"], 2),
            f"{_f(row['ms_p10'], 2)}-{_f(row['ms_p90'], 2)}",
            _f(row["server_ms_median"], 2) if row["part"] != "a" else "-",
            _f(row["overhead_ms_median"], 2),
            _f(row["decodes_per_round"], 2),
            _f(row["tokens_per_round"], 0)
            + (f" ({row['expected_tokens']})" if "expected_tokens" in row else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "ms: a = the server's predicted_per_token_ms; b-e = the client's wall time of one "
        "request (median, p10-p90 over the timed rounds).",
        "server ms: the slowest result's timings.prompt_ms + predicted_ms (the batch's "
        "decode as the server times it); other ms = ms - server ms: HTTP, JSON, tokens "
        "and task queue on both sides.",
        "decodes/round: llamacpp:n_decode_total per request (a: per generated token); "
        "tokens/round: llamacpp:prompt_tokens_total per request (expected for a steady "
        "round with k//2 accepted: (k+1)(k+2)/2 + j(j+1)/2).",
        "np: the server's -np; d: idle slots empty; e: the same round with -np k+1, or "
        "with every idle slot holding a stale context of the same length.",
        "i: a fresh prompt's wall time on a plain server (-np 1, RAM prompt cache on) "
        "while its slot held another; the samples' save_ms: its time outside the server's "
        "prompt and predict timings less the same on an emptied slot (the server's copy of "
        "the old prompt into its prompt cache).",
    ]
    for error in result.get("errors", []):
        notes.append(f"FAILED {error['variant']} ctx {error['context']}: {error['error']}")
    return "\n".join(lines + notes)


# -- command line -----------------------------------------------------------------


def _contexts(text: str) -> list[int]:
    """'512,4k' -> [512, 4096]."""
    return [c for c in context_list(text, natural=False) if c is not None]


def _parts(text: str) -> list[str]:
    return comma_choices(text, tuple(PARTS), "parts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, help="target GGUF (or --models)")
    parser.add_argument(
        "--models", type=Path, help="a `npu-spec make-models` folder: its target.gguf"
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        dest="variants",
        help="NAME=llama-server args, repeatable: --variant 'base=-ngl 99 -fa on'",
    )
    parser.add_argument(
        "--context", type=_contexts, default=[512], dest="contexts", help="e.g. 512,4k"
    )
    parser.add_argument("-k", type=int_list, default=[1, 2, 4, 6, 8], dest="ks", help="d's k")
    parser.add_argument(
        "--new-tokens", type=int_list, default=[1, 3, 5, 7, 9], help="c's m (1 is b's row)"
    )
    parser.add_argument(
        "--np-large", type=int, default=9, help="slots of the main server (>= max k + 1)"
    )
    parser.add_argument(
        "--np-ks",
        type=int_list,
        default=[4],
        help="e: for these k, -np k+1 vs --np-large with idle slots full ('none' skips)",
    )
    parser.add_argument(
        "--parts", type=_parts, default=list(PARTS), help="comma list of a,b,c,d,e,f,g,h,m,i"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per row")
    parser.add_argument("--plain-tokens", type=int, default=64, help="a: tokens generated")
    parser.add_argument("-t", "--threads", type=int, help="llama-server -t")
    parser.add_argument("--seed", type=int, default=0, help="random token ids")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary")
    parser.add_argument("--work-dir", type=Path, help="server logs and slot files (default: temp)")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for a server to load"
    )
    parser.add_argument(
        "-o", "--out", type=Path,
        help="result JSON (default: benchmarks/results/verify-cost-<time>.json)",
    )  # fmt: skip


def options_from_args(args: argparse.Namespace) -> VerifyCostOptions:
    target = args.target or (args.models / "target.gguf" if args.models else None)
    if target is None:
        raise SystemExit("give --target model.gguf or --models DIR")
    return VerifyCostOptions(
        target=target,
        variants=args.variants or [Variant("default", [])],
        contexts=args.contexts,
        ks=args.ks,
        new_tokens=args.new_tokens,
        np_large=args.np_large,
        np_ks=args.np_ks,
        parts=args.parts,
        repeats=args.repeats,
        warmup=args.warmup,
        plain_tokens=args.plain_tokens,
        threads=args.threads,
        seed=args.seed,
        llama_server=args.llama_server,
        work_dir=args.work_dir,
        startup_timeout=args.startup_timeout,
    )


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    out = args.out or default_result_path("verify-cost")
    result = asyncio.run(run_verify_cost(options, progress=out))
    write_json(result, out)
    print(render_table(result))
    print(f"\nraw results: {out}")
    return 1 if result["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="verify_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)
