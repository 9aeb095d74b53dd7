"""Hostile request bodies for every JSON endpoint: a seeded mutation fuzzer and
hypothesis strategies. Each case says what the proxy must answer: "4xx" (an error
in OpenAI format) or "no-5xx" (whatever llama-server itself accepts, e.g. a huge
top_k, may succeed, but nothing may fail on the server side)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

VOCAB = 151936  # the factory models' Qwen2 vocabulary

# A valid, cheap body per endpoint (the fuzz mutates these).
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": "Hello", "n_predict": 3, "temperature": 0},
    "/completions": {"prompt": "Hello", "n_predict": 3, "temperature": 0},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 3,
        "temperature": 0,
    },
    "/chat/completions": {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 3,
        "temperature": 0,
    },
    "/tokenize": {"content": "Hello", "add_special": True},
    "/detokenize": {"tokens": [9707, 11]},
    "/apply-template": {"messages": [{"role": "user", "content": "Hello"}]},
    "/slots/0?action=save": {"filename": "fuzz-slot.bin"},
}
# Not fuzzed: routes llama-server turns off unless started for them (/embedding*,
# /rerank, /infill without FIM tokens, POST /props): they answer 501 to every body.

LIMIT_FIELDS = {
    "/completion": "n_predict",
    "/completions": "n_predict",
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/chat/completions": "max_tokens",
}
TOKEN_FIELDS = {
    "/completion": "prompt",
    "/completions": "prompt",
    "/v1/completions": "prompt",
    "/tokenize": "content",
    "/detokenize": "tokens",
}
CHAT = {"/v1/chat/completions", "/chat/completions", "/apply-template"}

HUGE = [10**30, -(10**30), 2**63, 2**31, -(2**31) - 1, 1e308, -1e308]
BAD_LIMITS = [-2, -5, -(10**9), 2**31, 2**63, 10**30, 1e308, 3.5, "12", [], {}, True]
WRONG_TYPES: list[Any] = [None, True, 12, -3.5, "text", [], [None], {"a": 1}, [[["x"]]]]
ODD_ROLES = ["wizard", "", "USER", "root", "system\u0000", 5, None, ["user"], {"r": 1}]
BAD_TOKENS = [[VOCAB], [10**9], [-1], [2**40], [0, VOCAB + 7, 1]]


@dataclass
class Case:
    path: str
    kind: str  # the hostile-input class, a row of the reliability table
    body: bytes
    expect: str  # "4xx" or "no-5xx"
    max_body: int | None = None  # the proxy's limit this case is about, if any


def _dump(body: Any) -> bytes:
    return json.dumps(body).encode()


def _malformed(rng: random.Random, path: str, valid: dict) -> Case:
    raw = _dump(valid)
    variants = [
        raw[: rng.randrange(1, len(raw) - 1)],  # truncated
        b"",
        b"{" * rng.randint(2, 5000),  # deep or unterminated nesting
        b"[" * 100_000 + b"]" * 100_000,  # nested beyond any parser's recursion
        raw.replace(b":", b"=", 1),
        b"{'prompt': 'single quotes'}",
        b"null",
        b"[1, 2, 3]",
        b'"just a string"',
        raw + b"trailing",
    ]
    body = rng.choice(variants)
    return Case(path, "malformed JSON", body, "4xx")


def _invalid_utf8(rng: random.Random, path: str, valid: dict) -> Case:
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28", b"\x80"])
    raw = _dump(valid)
    cut = raw.find(b"Hello") if b"Hello" in raw else raw.find(b'"', 2) + 1
    if cut <= 0:  # no string to corrupt: corrupt a key
        cut = 2
    return Case(path, "invalid UTF-8", raw[:cut] + bad + raw[cut:], "4xx")


def _wrong_type(rng: random.Random, path: str, valid: dict) -> Case:
    body = dict(valid)
    key = rng.choice(sorted(body))
    value = rng.choice([v for v in WRONG_TYPES if type(v) is not type(body[key])])
    body[key] = value
    # only the fields every route needs are sure to be refused; an optional knob of
    # the wrong type may be ignored by the server, as it is without the proxy
    required = key in {"prompt", "messages", "tokens", "content"} or key == LIMIT_FIELDS.get(path)
    if key in {"prompt", "content"} and isinstance(value, list) and value in ([], [[["x"]]]):
        required = False  # [] is an empty prompt, which some routes accept
    if value is None and key == LIMIT_FIELDS.get(path):
        required = False  # null means "the default", as in OpenAI's API
    return Case(path, "wrong types", _dump(body), "4xx" if required else "no-5xx")


def _huge_number(rng: random.Random, path: str, valid: dict) -> Case:
    body = dict(valid)
    key = rng.choice(["temperature", "top_k", "top_p", "seed", "n_probs", "min_p", "repeat_last_n"])
    body[key] = rng.choice(HUGE)
    return Case(path, "huge numbers in sampling fields", _dump(body), "no-5xx")


def _absurd_limit(rng: random.Random, path: str, valid: dict) -> Case:
    body = dict(valid)
    key = LIMIT_FIELDS.get(path, "n_predict")
    value = rng.choice(BAD_LIMITS)
    body[key] = value
    expect = "4xx" if path in LIMIT_FIELDS else "no-5xx"
    return Case(path, "negative or absurd max_tokens / n_predict", _dump(body), expect)


def _enormous_prompt(rng: random.Random, path: str, valid: dict) -> Case:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(6000))
    body = dict(valid)
    if path in CHAT:
        body["messages"] = [{"role": "user", "content": words}]
    elif "prompt" in body:
        body["prompt"] = words
    elif "content" in body:
        body["content"] = words  # tokenizing a long text is allowed: no-5xx
    elif "tokens" in body:
        body["tokens"] = [rng.randrange(VOCAB) for _ in range(20000)]
    else:
        body["filename"] = "x" * 100_000
    expect = "4xx" if ("prompt" in body or path in CHAT) and path != "/apply-template" else "no-5xx"
    return Case(path, "enormous prompt (beyond the context)", _dump(body), expect)


def _over_limit(rng: random.Random, path: str, valid: dict) -> Case:
    body = dict(valid)
    body["padding"] = "x" * (300_000 + rng.randrange(1000))
    return Case(path, "body over the size limit", _dump(body), "4xx", max_body=256 * 1024)


def _many_messages(rng: random.Random, path: str, valid: dict) -> Case:
    n = rng.choice([2000, 5000])
    messages = [{"role": rng.choice(["user", "assistant"]), "content": "hi"} for _ in range(n)]
    messages.append({"role": "user", "content": "last"})
    body = {**valid, "messages": messages}
    expect = "4xx" if path in CHAT and path != "/apply-template" else "no-5xx"
    return Case(path, "enormous message list", _dump(body), expect)


def _unknown_role(rng: random.Random, path: str, valid: dict) -> Case:
    body = {**valid, "messages": [{"role": rng.choice(ODD_ROLES), "content": "hi"}]}
    return Case(path, "unknown roles", _dump(body), "4xx" if path in CHAT else "no-5xx")


def _bad_tokens(rng: random.Random, path: str, valid: dict) -> Case:
    body = dict(valid)
    key = TOKEN_FIELDS.get(path, "prompt")
    body[key] = rng.choice(BAD_TOKENS)
    if path == "/tokenize":
        body["with_pieces"] = rng.choice([True, False])
    expect = "4xx" if path in TOKEN_FIELDS else "no-5xx"
    return Case(path, "token ids out of the vocabulary", _dump(body), expect)


def _slot_filename(rng: random.Random, path: str, valid: dict) -> Case:
    name = rng.choice(["../../etc/passwd", "/abs/path", "a/b", "..", "npu-spec-x-g0.bin", ""])
    return Case(path, "hostile slot file names", _dump({"filename": name}), "4xx")


MUTATORS: list[Callable[[random.Random, str, dict], Case]] = [
    _malformed, _invalid_utf8, _wrong_type, _huge_number, _absurd_limit, _enormous_prompt,
    _over_limit, _many_messages, _unknown_role, _bad_tokens,
]  # fmt: skip


def fuzz_cases(seed: int, per_endpoint: int) -> list[Case]:
    """The same `per_endpoint` mutations of each endpoint's valid body on every run."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for path, valid in ENDPOINTS.items():
        for i in range(per_endpoint):
            if path.startswith("/slots/") and i % 2 == 0:
                cases.append(_slot_filename(rng, path, valid))
                continue
            mutate = MUTATORS[(i + rng.randrange(len(MUTATORS))) % len(MUTATORS)]
            cases.append(mutate(rng, path, valid))
    return cases


# -- hypothesis strategies -------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


json_values = st.recursive(json_scalars, _containers, max_leaves=12)
absurd_limits = st.one_of(
    st.integers(max_value=-2),
    st.integers(min_value=2**31),
    st.floats(allow_nan=False).filter(lambda x: abs(x) >= 2**31 or not x.is_integer()),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.booleans(),
)
_bad_id = st.one_of(st.integers(min_value=VOCAB, max_value=2**62), st.integers(max_value=-1))
out_of_vocab = st.tuples(
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=4), _bad_id
).map(lambda pair: [*pair[0], pair[1]])
odd_roles = st.one_of(
    st.text(max_size=12).filter(lambda role: role not in ROLES),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=2),
)
