"""Hostile-input suite: a seeded fuzz run over the JSON body of every endpoint and
hypothesis properties, against the proxy in front of a real llama-server. Every
hostile request gets a 4xx in OpenAI format (or, for knobs the server itself
accepts, a normal answer): never a 5xx, never a hang, never a crash, and the next
valid request succeeds with everything released."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.api.guard import bad_role, keys_match, out_of_vocab
from proxy.api.requests import NotEligible, parse_chat, parse_completion
from tests.reliability import hostile
from tests.reliability.tools import Proxy, is_openai_error, proxy_for, record, server_idle

FUZZ_SEED = 8
FUZZ_PER_ENDPOINT = 30
MAX_BODY = 256 * 1024  # small, so the over-limit class stays cheap
REQUEST_BOUND_S = 30.0  # "no hang": every answer within this
VALID = {"prompt": "Still alive", "n_predict": 4, "temperature": 0, "return_tokens": True}


async def _send(proxy: Proxy, path: str, body: bytes) -> tuple[int, Any, float]:
    started = time.monotonic()
    async with asyncio.timeout(REQUEST_BOUND_S):
        status, payload, _ = await proxy.post(path, body)
    return status, payload, time.monotonic() - started


async def _still_serving(proxy: Proxy, spec_server: str) -> None:
    status, payload, _ = await proxy.post("/completion", VALID)
    assert status == 200 and len(payload["tokens"]) == 4, payload
    assert proxy.idle()
    assert await server_idle(spec_server)


def _check(case_expect: str, status: int, payload: Any) -> str | None:
    """None when the answer is acceptable, else what is wrong."""
    if status >= 500:
        return f"HTTP {status}"
    if 400 <= status < 500 and not is_openai_error(payload, status):
        return f"HTTP {status} not in OpenAI error format: {str(payload)[:120]}"
    if case_expect == "4xx" and not 400 <= status < 500:
        return f"expected a 4xx, got HTTP {status}"
    return None


@pytest.mark.server
async def test_fuzz_every_endpoint(request, spec_server, reference_drafter):
    cases = hostile.fuzz_cases(FUZZ_SEED, FUZZ_PER_ENDPOINT)
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    failures: list[str] = []
    slowest = 0.0
    async with proxy_for(spec_server, reference_drafter, k=2, max_body_bytes=MAX_BODY) as proxy:
        for i, case in enumerate(cases):
            status, payload, elapsed = await _send(proxy, case.path, case.body)
            slowest = max(slowest, elapsed)
            outcomes[case.kind][f"{case.expect}:{status // 100}xx"] += 1
            problem = _check(case.expect, status, payload)
            if problem:
                failures.append(f"{case.kind} on {case.path}: {problem}; body {case.body[:100]!r}")
            if i % 10 == 9:  # the next valid request succeeds, everything released
                await _still_serving(proxy, spec_server)
        await _still_serving(proxy, spec_server)
    assert not failures, "\n".join(failures[:20])
    for kind, counts in sorted(outcomes.items()):
        invalid = {k.split(":")[1]: n for k, n in counts.items() if k.startswith("4xx:")}
        ignored = {k.split(":")[1]: n for k, n in counts.items() if k.startswith("no-5xx:")}
        parts = []
        if invalid:
            parts.append(f"{sum(invalid.values())} invalid for the route: all 4xx")
        if ignored:
            answered = ", ".join(f"{n} x {s}" for s, n in sorted(ignored.items()))
            parts.append(
                f"{sum(ignored.values())} that llama-server alone accepts or ignores (a "
                f"field the route does not read, or a value it clamps): {answered}"
            )
        record(
            request.node.nodeid, "hostile (fuzz)", kind, sum(counts.values()),
            "; ".join(parts) + f"; no 5xx, 4xx always in OpenAI format, slowest answer "
            f"{slowest:.1f} s; a valid request after every 10 cases served",
            command="pytest tests/reliability/test_hostile.py -q -k fuzz",
        )  # fmt: skip


# -- hypothesis against the live proxy ---------------------------------------------

LIVE = settings(settings.get_profile("reliability"), max_examples=25)


@pytest.fixture
async def live_proxy(spec_server, reference_drafter):
    async with proxy_for(spec_server, reference_drafter, k=2, max_body_bytes=MAX_BODY) as proxy:
        yield proxy
        await _still_serving(proxy, spec_server)


_counts: Counter[str] = Counter()


@pytest.mark.server
@LIVE
@given(
    path=st.sampled_from(sorted(hostile.LIMIT_FIELDS)),
    limit=hostile.absurd_limits,
    stream=st.booleans(),
)
async def test_property_absurd_token_limits_are_4xx(live_proxy, path, limit, stream):
    body = dict(hostile.ENDPOINTS[path])
    body[hostile.LIMIT_FIELDS[path]] = limit
    body["stream"] = stream
    status, payload, _ = await _send(live_proxy, path, json.dumps(body).encode())
    assert 400 <= status < 500 and is_openai_error(payload, status), (status, payload)
    _counts["negative or absurd max_tokens / n_predict"] += 1


@pytest.mark.server
@LIVE
@given(
    path=st.sampled_from(["/completion", "/v1/completions", "/detokenize", "/tokenize"]),
    tokens=hostile.out_of_vocab,
)
async def test_property_out_of_vocabulary_ids_are_4xx(live_proxy, path, tokens):
    body = dict(hostile.ENDPOINTS[path])
    body[hostile.TOKEN_FIELDS[path]] = tokens
    status, payload, _ = await _send(live_proxy, path, json.dumps(body).encode())
    assert 400 <= status < 500 and is_openai_error(payload, status), (status, payload)
    _counts["token ids out of the vocabulary"] += 1


@pytest.mark.server
@LIVE
@given(
    path=st.sampled_from(sorted(hostile.CHAT)),
    role=hostile.odd_roles,
    position=st.integers(0, 2),
)
async def test_property_unknown_roles_are_4xx(live_proxy, path, role, position):
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"} for _ in range(3)]
    messages[position] = {"role": role, "content": "hi"}
    body = {**hostile.ENDPOINTS[path], "messages": messages}
    status, payload, _ = await _send(live_proxy, path, json.dumps(body).encode())
    assert 400 <= status < 500 and is_openai_error(payload, status), (status, payload)
    _counts["unknown roles"] += 1


@pytest.mark.server
@LIVE
@given(
    path=st.sampled_from(sorted(hostile.ENDPOINTS)),
    body=st.dictionaries(
        st.sampled_from(
            [
                "prompt",
                "messages",
                "n_predict",
                "max_tokens",
                "tokens",
                "content",
                "stop",
                "temperature",
                "stream",
                "filename",
                "id_slot",
            ]
        ),
        hostile.json_values,
        max_size=5,
    ),
)
async def test_property_arbitrary_json_never_5xx(live_proxy, path, body):
    # bounded generation: whatever the body says, at most a few tokens
    for key in ("n_predict", "max_tokens"):
        if (isinstance(body.get(key), int) and body[key] > 8) or body.get(key) == -1:
            body[key] = 8
    if not any(k in body for k in ("n_predict", "max_tokens")):
        body["n_predict"] = 4
    status, payload, _ = await _send(live_proxy, path, json.dumps(body).encode())
    assert _check("no-5xx", status, payload) is None, (status, payload)
    _counts["arbitrary JSON bodies (hypothesis)"] += 1


def test_hypothesis_counts_recorded(request):
    # runs after the live properties above (file order)
    assert _counts, "the live properties did not run"
    for kind, n in sorted(_counts.items()):
        record(
            request.node.nodeid, "hostile (hypothesis)", kind, n,
            "4xx in OpenAI format for every example" if "arbitrary" not in kind
            else "no 5xx, every 4xx in OpenAI format",
            command="pytest tests/reliability/test_hostile.py -q -k property",
        )  # fmt: skip


# -- pure properties (no server) ------------------------------------------------------


@settings(settings.get_profile("reliability"), max_examples=200)
@given(body=hostile.json_values, oai=st.booleans())
def test_property_request_parsing_only_ever_says_not_eligible(body, oai):
    defaults = {"temperature": 0.8, "top_k": 40, "n_predict": -1}
    for parse in (
        lambda: parse_completion(body, defaults, oai=oai),
        lambda: parse_chat(body, defaults),
        lambda: parse_completion({"prompt": body, "temperature": 0}, defaults, oai=oai),
        lambda: parse_chat({"messages": body, "temperature": 0}, defaults),
    ):
        with contextlib.suppress(NotEligible):
            parse()


@settings(settings.get_profile("reliability"), max_examples=200)
@given(body=hostile.json_values, path=st.sampled_from(sorted(hostile.ENDPOINTS)))
def test_property_guards_never_raise(body, path):
    for candidate in (body, {"tokens": body}, {"content": body}, {"messages": body}):
        out_of_vocab(path.split("?")[0], candidate, hostile.VOCAB)
        bad_role(path, candidate)


@settings(settings.get_profile("reliability"), max_examples=200)
@given(given_key=st.text(max_size=40), expected=st.text(min_size=1, max_size=40))
def test_property_api_key_comparison_is_exact(given_key, expected):
    assert keys_match(given_key, expected) == (given_key == expected)
    assert keys_match(expected, expected)
