"""Comparison helpers: equality with llama-server alone, near-ties proven, not assumed."""

from __future__ import annotations

import json
import math

import aiohttp

from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP, top2_gap


async def post_json(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def tokenize(http: aiohttp.ClientSession, base: str, text: str) -> list[int]:
    payload = await post_json(http, base + "/tokenize", {"content": text, "add_special": True})
    return payload["tokens"]


async def assert_greedy_equal(
    http: aiohttp.ClientSession,
    ref_url: str,
    prompt: list[int],
    expected: list[int],
    got: list[int],
) -> int:
    """Assert `got` == `expected`, except after a proven near-tie. Returns the
    number of positions compared."""
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want == have:
            continue
        ids, gap = await top2_gap(http, ref_url, prompt + expected[:i])
        assert have in ids and gap < NEAR_TIE_LOGIT_GAP, (
            f"token {i}: proxy wrote {have}, llama-server alone {want}; top-2 {ids} with "
            f"logit gap {gap:.4f} is not a near-tie"
        )
        return i
    assert len(got) == len(expected), f"lengths differ: {len(got)} vs {len(expected)}"
    return len(got)


def parse_sse(raw: bytes) -> tuple[list[dict], bool]:
    """Events of a `data: ...` stream and whether it ended with [DONE]."""
    events: list[dict] = []
    done = False
    for block in raw.decode("utf-8").split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    return events, done


def shape(value):
    """A JSON value's structure: keys and types, not values."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value[:1]]
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def finite(value: float) -> bool:
    return math.isfinite(value)


async def stable_length(
    http: aiohttp.ClientSession,
    ref_url: str,
    prompt: list[int],
    n: int,
    margin: float = NEAR_TIE_LOGIT_GAP,
) -> int:
    """How many greedy tokens after `prompt` come before the first near-tie.

    Routes that return no token ids (chat, OpenAI text) are compared over this many
    tokens, so a float-order flip at a proven near-tie cannot fail them spuriously.
    """
    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": True}
    tokens = (await post_json(http, ref_url + "/completion", body))["tokens"]
    for i in range(len(tokens)):
        _, gap = await top2_gap(http, ref_url, prompt + tokens[:i])
        if gap < margin:
            return i
    return len(tokens)


async def chat_prompt_tokens(http: aiohttp.ClientSession, base: str, body: dict) -> list[int]:
    prompt = (await post_json(http, base + "/apply-template", body))["prompt"]
    return await tokenize(http, base, prompt)
