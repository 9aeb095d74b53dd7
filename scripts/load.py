#!/usr/bin/env python
"""Load test for the npu-spec proxy: N concurrent streaming conversations.

Each conversation sends turns until the time is up: mixed lengths (max tokens drawn
per turn) and mixed temperatures (greedy turns on /completion with token ids,
sampled turns on /v1/chat/completions), every turn streamed. Afterwards every
greedy turn is run again alone and must give the same tokens. Reports latency and
time-to-first-token percentiles, throughput, errors, 503s, and the most slot groups
and queued requests seen on the proxy's /metrics.

Loopback only: the URL must point at 127.0.0.1, ::1 or localhost.

    python scripts/load.py --url http://127.0.0.1:8080 --conversations 16 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# Logit gap under which the target's top two tokens count as tied: a different batch
# layout (other conversations in the same llama_decode) changes the float summation
# order, which can flip only such a pair. Same bound as tests/proxy/helpers.py.
NEAR_TIE_LOGIT_GAP = 0.02
TOPICS = ["the sea", "a small robot", "bread", "mountains", "a lost key", "winter", "trains"]


@dataclass
class Turn:
    conversation: int
    route: str
    body: dict[str, Any]
    status: int = 0
    error: str | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: list[int] = field(default_factory=list)  # as streamed (see `positions`)
    # (index, token) of every streamed token: like llama-server, the proxy sends no
    # chunk for a token that ends inside a UTF-8 character, so the stream's token
    # list has gaps; `tokens_predicted` places each token that was sent.
    positions: list[tuple[int, int]] = field(default_factory=list)
    text: str = ""
    n_generated: int = 0
    solo_equal: bool | None = None  # greedy turns only, after verification
    solo_tokens: list[int] | None = None
    near_tie: bool | None = None  # a mismatch proven (with --reference) to be a near-tie flip
    first_difference: int | None = None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


async def _stream_turn(session: aiohttp.ClientSession, url: str, turn: Turn) -> None:
    started = time.monotonic()
    try:
        async with session.post(url + turn.route, json=turn.body) as response:
            turn.status = response.status
            if response.status != 200:
                turn.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            done = False
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    turn.error = f"error event: {event['error']}"
                    return
                if turn.ttft_s is None:
                    turn.ttft_s = time.monotonic() - started
                if "choices" in event:  # chat chunk
                    for choice in event["choices"]:
                        turn.text += (choice.get("delta") or {}).get("content") or ""
                else:  # native
                    if event.get("stop"):
                        done = True
                        turn.n_generated = event.get("tokens_predicted", len(turn.tokens))
                    else:
                        tokens = event.get("tokens", [])
                        turn.tokens += tokens
                        if len(tokens) == 1 and "tokens_predicted" in event:
                            turn.positions.append((event["tokens_predicted"] - 1, tokens[0]))
                        turn.text += event.get("content", "")
            if not done:
                turn.error = "stream ended without its final event"
            if turn.route != "/completion":
                turn.n_generated = len(turn.text)  # characters: chat gives no token ids
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    finally:
        turn.latency_s = time.monotonic() - started


async def _conversation(
    index: int,
    session: aiohttp.ClientSession,
    url: str,
    deadline: float,
    args: argparse.Namespace,
    turns: list[Turn],
) -> None:
    rng = random.Random(args.seed * 1000 + index)
    history = f"A story about {rng.choice(TOPICS)}."
    while time.monotonic() < deadline:
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        temperature = rng.choice(args.temperatures)
        if temperature == 0:
            body = {
                "prompt": history[-args.max_history_chars :],
                "n_predict": max_tokens,
                "temperature": 0,
                "stream": True,
                "return_tokens": True,
            }
            turn = Turn(index, "/completion", body)
        else:
            body = {
                "messages": [{"role": "user", "content": history[-args.max_history_chars :]}],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": rng.randint(0, 2**31 - 1),
                "stream": True,
            }
            turn = Turn(index, "/v1/chat/completions", body)
        turns.append(turn)
        await _stream_turn(session, url, turn)
        if turn.error is None:
            history += turn.text
        else:
            await asyncio.sleep(0.2)  # e.g. 503 + Retry-After: back off, bounded by the deadline


async def _sample_metrics(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, seen: dict[str, float]
) -> None:
    names = (
        "npu_spec_slot_groups_active", "npu_spec_queue_length", "npu_spec_streams_active",
        "npu_spec_streams_speculating",
    )  # fmt: skip
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    name, _, value = line.partition(" ")
                    if name in names:
                        seen[name] = max(seen.get(name, 0.0), float(value))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _verify_solo(session: aiohttp.ClientSession, url: str, turns: list[Turn], limit: int):
    """Run greedy turns again, one at a time, without streaming: same text, same
    number of tokens, and the same token at every position the stream placed."""
    greedy = [t for t in turns if t.route == "/completion" and t.error is None]
    for turn in greedy[:limit]:
        body = {**turn.body, "stream": False}
        async with session.post(url + "/completion", json=body) as response:
            solo = await response.json() if response.status == 200 else None
        if solo is None:
            turn.solo_equal = False
            continue
        tokens = turn.solo_tokens = solo.get("tokens", [])
        wrong = [i for i, tok in turn.positions if i >= len(tokens) or tokens[i] != tok]
        content = solo.get("content", "")
        # a stream never sends a trailing incomplete UTF-8 character; the non-streamed
        # answer shows it as U+FFFD
        tail = content[len(turn.text) :] if content.startswith(turn.text) else None
        turn.solo_equal = (
            not wrong
            and tail is not None
            and set(tail) <= {"\ufffd"}
            and len(tokens) == turn.n_generated
        )
        if not turn.solo_equal:
            turn.first_difference = min(wrong) if wrong else None


async def run_load(
    url: str,
    conversations: int = 16,
    duration_s: float = 30.0,
    min_tokens: int = 8,
    max_tokens: int = 96,
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.7),
    seed: int = 0,
    request_timeout_s: float = 120.0,
    verify: bool = True,
    verify_limit: int = 200,
    max_history_chars: int = 400,
    api_key: str | None = None,
    reference: str | None = None,
) -> dict[str, Any]:
    """Drive the load, then verify greedy turns; returns the report (a dict).

    `reference`: URL of llama-server alone, to prove that any greedy mismatch is a
    flip at a near-tie (and nothing else)."""
    for target in (url, reference):
        if target is not None and urlsplit(target).hostname not in LOOPBACK:
            raise ValueError(f"loopback only: {target} is not 127.0.0.1, ::1 or localhost")
    url = url.rstrip("/")
    args = argparse.Namespace(
        min_tokens=min_tokens, max_tokens=max_tokens, temperatures=list(temperatures),
        seed=seed, max_history_chars=max_history_chars,
    )  # fmt: skip
    turns: list[Turn] = []
    seen: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=conversations + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=headers
    ) as session:
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_metrics(session, url, stop, seen))
        started = time.monotonic()
        deadline = started + duration_s
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    _conversation(i, session, url, deadline, args, turns)
                    for i in range(conversations)
                )
            ),
            duration_s + request_timeout_s,  # turns in flight at the deadline finish
        )
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        if verify:
            await _verify_solo(session, url, turns, verify_limit)
            if reference is not None:
                await _prove_near_ties(session, reference.rstrip("/"), turns)
    ok = [t for t in turns if t.error is None]
    errors: dict[str, int] = {}
    error_examples: dict[str, str] = {}  # the first message of each kind, to say why
    for turn in turns:
        if turn.error is not None:
            key = f"HTTP {turn.status}" if turn.status not in (0, 200) else turn.error[:60]
            errors[key] = errors.get(key, 0) + 1
            error_examples.setdefault(key, turn.error[:300])
    verified = [t for t in turns if t.solo_equal is not None]
    greedy_tokens = sum(t.n_generated for t in ok if t.route == "/completion")
    return {
        "url": url,
        "conversations": conversations,
        "duration_s": round(elapsed, 2),
        "requests": len(turns),
        "succeeded": len(ok),
        "errors": errors,
        "error_examples": error_examples,
        "http_503": sum(1 for t in turns if t.status == 503),
        "latency_s": percentiles([t.latency_s for t in ok]),
        "ttft_s": percentiles([t.ttft_s for t in ok if t.ttft_s is not None]),
        "greedy_tokens": greedy_tokens,
        "greedy_tokens_per_s": round(greedy_tokens / elapsed, 2) if elapsed else 0.0,
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "mean_tokens_per_request": round(statistics.mean([len(t.tokens) for t in ok]), 1)
        if ok
        else 0.0,
        "max_slot_groups_active": seen.get("npu_spec_slot_groups_active"),
        "max_streams_active": seen.get("npu_spec_streams_active"),
        "max_streams_speculating": seen.get("npu_spec_streams_speculating"),
        "max_queue_length": seen.get("npu_spec_queue_length"),
        "greedy_verified": len(verified),
        "greedy_equal_to_solo": sum(1 for t in verified if t.solo_equal),
        "near_tie_flips": sum(1 for t in verified if t.near_tie),
        "unexplained_mismatches": sum(1 for t in verified if not t.solo_equal and not t.near_tie),
        "mismatches": [
            {
                "conversation": t.conversation,
                "prompt": t.body["prompt"],
                "first": t.first_difference,
                "concurrent": t.positions,
                "concurrent_text": t.text,
                "solo": t.solo_tokens,
                "near_tie": t.near_tie,
            }
            for t in verified
            if not t.solo_equal
        ],
        "turns": [asdict(t) for t in turns],
    }


async def _prove_near_ties(
    session: aiohttp.ClientSession, reference: str, turns: list[Turn]
) -> None:
    """For each greedy mismatch, ask llama-server alone (`reference`, one slot) for the
    top two tokens where the runs part: a flip is accepted only at a near-tie."""
    for turn in turns:
        if turn.solo_equal is not False or turn.first_difference is None or not turn.solo_tokens:
            continue
        first = turn.first_difference
        async with session.post(
            reference + "/tokenize", json={"content": turn.body["prompt"], "add_special": True}
        ) as response:
            prompt = (await response.json())["tokens"]
        body = {
            "prompt": prompt + turn.solo_tokens[:first],
            "n_predict": 1,
            "n_probs": 2,
            "temperature": 0.0,
        }
        async with session.post(reference + "/completion", json=body) as response:
            top = (await response.json())["completion_probabilities"][0]["top_logprobs"]
        ids = [t["id"] for t in top]
        gap = top[0]["logprob"] - top[1]["logprob"]
        concurrent = dict(turn.positions)[first]
        turn.near_tie = concurrent in ids and gap < NEAR_TIE_LOGIT_GAP


def _summary(report: dict[str, Any]) -> str:
    lat, ttft = report["latency_s"], report["ttft_s"]

    def fmt(p: dict[str, float]) -> str:
        return " ".join(f"{k} {v * 1e3:.0f} ms" for k, v in p.items()) or "-"

    return "\n".join(
        [
            f"{report['requests']} requests from {report['conversations']} conversations in "
            f"{report['duration_s']} s: {report['succeeded']} ok, errors {report['errors'] or 0}"
            f" (503: {report['http_503']})",
            f"latency  {fmt(lat)}",
            f"ttft     {fmt(ttft)}",
            f"throughput {report['greedy_tokens_per_s']} greedy tokens/s, "
            f"{report['requests_per_s']} requests/s",
            f"slot groups active at most {report['max_slot_groups_active']}, "
            f"queue at most {report['max_queue_length']}",
            f"greedy equal to solo run: {report['greedy_equal_to_solo']}/"
            f"{report['greedy_verified']}, proven near-tie flips {report['near_tie_flips']}, "
            f"unexplained {report['unexplained_mismatches']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0,0,0.7", help="drawn per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument(
        "--reference", help="llama-server alone (one slot): proves greedy flips are near-ties"
    )
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument(
        "--api-key-env", default="NPU_SPEC_API_KEY", help="environment variable with the key"
    )
    args = parser.parse_args(argv)
    report = asyncio.run(
        run_load(
            args.url,
            args.conversations,
            args.duration,
            args.min_tokens,
            args.max_tokens,
            tuple(float(t) for t in args.temperatures.split(",")),
            args.seed,
            args.request_timeout,
            not args.no_verify,
            api_key=os.environ.get(args.api_key_env),
            reference=args.reference,
        )
    )
    print(_summary(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    failed = report["errors"] or report["unexplained_mismatches"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
