"""The HTTP checks of scripts/compose_smoke.sh against a running compose stack.

    python -m tests.deploy.smoke_checks greedy --proxy URL --reference URL --key KEY
    python -m tests.deploy.smoke_checks auth --proxy URL --server URL --key KEY [--host-ip IP]

`greedy`: one greedy chat through the proxy must equal the same chat on llama-server
alone (compose's `llama-server-plain`, one slot, no drafting) token for token, or part
from it only at a near-tie that llama-server itself shows (proxy/bench/neartie.py), and
the proxy must say it answered speculatively (X-Npu-Spec). `auth`: the key of `.env` is
asked for by the proxy and by the published llama-server port alike, and that port is
bound to loopback only. Each prints one line per fact and exits non-zero on the first
failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request
from typing import Any

import aiohttp

from proxy.bench.neartie import explain_mismatch

CHAT = [{"role": "user", "content": "Count from one to twenty in words, then say why."}]
MAX_TOKENS = 48
SPEC_HEADER = "X-Npu-Spec"


class CheckFailed(Exception):
    """One line saying what the stack did wrong."""


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _status(url: str, key: str | None, body: dict[str, Any] | None = None) -> int:
    """HTTP status of a GET (or a POST of `body`); urllib raises on 4xx, so catch it."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **_bearer(key)}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


async def _chat(session: aiohttp.ClientSession, base: str) -> tuple[str, int, str | None]:
    """(content, completion tokens, X-Npu-Spec) of one greedy chat."""
    body = {"messages": CHAT, "temperature": 0.0, "max_tokens": MAX_TOKENS, "stream": False}
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise CheckFailed(f"chat at {base}: HTTP {response.status}: {text[:200]}")
        answer = json.loads(text)
        content = answer["choices"][0]["message"]["content"]
        return content, answer["usage"]["completion_tokens"], response.headers.get(SPEC_HEADER)


async def _counters(session: aiohttp.ClientSession, proxy: str) -> dict[str, float]:
    """The proxy's token counters (/metrics): what it drafted, accepted and ran plainly."""
    names = ("draft_tokens_total", "accepted_tokens_total", "plain_run_tokens_total")
    async with session.get(f"{proxy}/metrics") as response:
        text = await response.text()
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("npu_spec_") in values:
            values[name.removeprefix("npu_spec_")] = float(value)
    return values


async def _tokens(session: aiohttp.ClientSession, server: str, text: str, special: bool) -> list:
    body = {"content": text, "add_special": special, "parse_special": True}
    async with session.post(f"{server}/tokenize", json=body) as response:
        return (await response.json())["tokens"]


async def _prompt_tokens(session: aiohttp.ClientSession, server: str) -> list[int]:
    """The chat's prompt as the server's own template renders it."""
    async with session.post(f"{server}/apply-template", json={"messages": CHAT}) as response:
        prompt = (await response.json())["prompt"]
    return await _tokens(session, server, prompt, special=True)


async def greedy(proxy: str, reference: str, key: str | None) -> None:
    async with aiohttp.ClientSession(headers=_bearer(key)) as session:
        want, want_n, plain_header = await _chat(session, reference)
        before = await _counters(session, proxy)
        got, got_n, spec = await _chat(session, proxy)
        after = await _counters(session, proxy)
        if plain_header is not None:
            raise CheckFailed(f"the reference answered with {SPEC_HEADER}: not llama-server alone")
        if spec != "speculative":
            raise CheckFailed(f"proxy answered with {SPEC_HEADER}: {spec}, not speculative")
        drafted, accepted, plain = (after[name] - before[name] for name in after)
        print(f"{SPEC_HEADER}: {spec}; this chat: {drafted:.0f} tokens drafted, "
              f"{accepted:.0f} accepted, {plain:.0f} by plain runs")  # fmt: skip
        if not want_n:
            raise CheckFailed("llama-server alone answered nothing: nothing to compare")
        if (got, got_n) == (want, want_n):
            print(f"greedy: equal to llama-server alone, {want_n} of {want_n} tokens: {want!r}")
            return
        want_ids = await _tokens(session, reference, want, special=False)
        got_ids = await _tokens(session, reference, got, special=False)
        position = next(
            (i for i, (a, b) in enumerate(zip(want_ids, got_ids, strict=False)) if a != b),
            min(len(want_ids), len(got_ids)),
        )
        prompt = await _prompt_tokens(session, reference)
        tie = await explain_mismatch(session, reference, prompt, want_ids, got_ids, position)
        if not tie["near_tie"]:
            raise CheckFailed(
                f"greedy: proxy left llama-server alone at token {position} and it is no "
                f"near-tie ({tie}); proxy {got!r}, alone {want!r}"
            )
        print(f"greedy: proven near-tie at token {position} (logit gap "
              f"{tie['logit_gap']:.4f}): proxy {got!r}, alone {want!r}")  # fmt: skip


def auth(proxy: str, server: str, key: str, host_ip: str | None) -> None:
    chat = {"messages": CHAT, "max_tokens": 1}
    for name, base in (("proxy", proxy), ("llama-server (published port)", server)):
        for label, presented in (("no key", None), ("a wrong key", key + "x")):
            status = _status(f"{base}/v1/chat/completions", presented, chat)
            if status != 401:
                raise CheckFailed(f"{name} answered HTTP {status} to a chat with {label}")
        if (status := _status(f"{base}/v1/chat/completions", key, chat)) != 200:
            raise CheckFailed(f"{name} answered HTTP {status} to a chat with the key")
        if (status := _status(f"{base}/health", None)) != 200:
            raise CheckFailed(f"{name} /health answered HTTP {status} without a key")
        print(f"{name}: 401 without the key or with a wrong one, 200 with it; /health open")
    if host_ip:
        port = server.rsplit(":", 1)[1]
        try:
            urllib.request.urlopen(f"http://{host_ip}:{port}/health", timeout=5)
        except (urllib.error.URLError, OSError) as error:
            print(f"llama-server: not reachable at {host_ip}:{port} ({error}): loopback only")
        else:
            raise CheckFailed(f"llama-server answers at {host_ip}:{port}, not loopback only")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    g = sub.add_parser("greedy")
    g.add_argument("--proxy", required=True)
    g.add_argument("--reference", required=True)
    g.add_argument("--key")
    a = sub.add_parser("auth")
    a.add_argument("--proxy", required=True)
    a.add_argument("--server", required=True)
    a.add_argument("--key", required=True)
    a.add_argument("--host-ip", help="a non-loopback address of this host")
    args = parser.parse_args(argv)
    try:
        if args.check == "greedy":
            asyncio.run(greedy(args.proxy, args.reference, args.key))
        else:
            auth(args.proxy, args.server, args.key, args.host_ip)
    except (CheckFailed, aiohttp.ClientError, OSError) as error:
        print(f"FAIL: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
