"""Comparison helpers: equality with llama-server alone, near-ties proven, not assumed."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP, top2_gap
from proxy.config import ProxySettings
from proxy.engine import EngineSettings, Generation, GenerationParams, GenerationResult, RoundRecord
from proxy.engine.drafting import AsyncDrafter, DrafterBase, GreedyDraft, StopRule
from proxy.engine.server_text import PieceCache
from proxy.policies import PlainRunGate, Policies
from proxy.server.upstream import UpstreamClient

# Test proxies wait as long as their tests do: no queue bound, no limit on a passed-through
# answer's silence (the CLI always sets both; tests that check a bound give one).
_UNBOUNDED_IN_TESTS = {"max_queue": None, "passthrough_read_timeout_s": None}


def with_gate(settings: EngineSettings, gate: PlainRunGate) -> Policies:
    """A greedy generation's policies as `settings` build them, with a scripted gate."""
    return replace(settings.policies().for_request(None), plain_runs=gate)


def proxy_settings(upstream_url: str, k: int, **overrides: Any) -> ProxySettings:
    """The settings of an in-process test proxy attached to `upstream_url`: the CLI's
    defaults, `overrides` (validated), and no bounds on waiting unless given.

    Plain runs are off unless a test asks for them: the engine then answers every
    request. With the CLI's `auto`, the tiny test model decodes so fast that the gate may
    measure the numpy drafter as too slow to win and pass later requests through whole,
    depending on the machine's speed (tests/proxy/test_plain_runs_server.py tests that)."""
    overrides.setdefault("plain_runs", "off")
    settings = ProxySettings(upstream=upstream_url, k=k, **overrides)
    unbounded = {name: v for name, v in _UNBOUNDED_IN_TESTS.items() if name not in overrides}
    return settings.model_copy(update=unbounded)


def split_options(upstream_url: str, k: int, **options: Any) -> tuple[ProxySettings, dict]:
    """(settings, the rest) for `build_state`: options named like a setting override
    it; the others (`scheduler=`, `replace_upstream_auth=`) stand for what serve() starts."""
    overrides = {name: v for name, v in options.items() if name in ProxySettings.model_fields}
    started = {name: v for name, v in options.items() if name not in overrides}
    return proxy_settings(upstream_url, k, **overrides), started


@contextlib.asynccontextmanager
async def server_pair(ref: Any, spec: Any) -> AsyncIterator[tuple[str, str]]:
    """Start llama-server alone (`ref`) and the speculative layout's server (`spec`),
    yield their base URLs, and stop both whatever happens."""
    await ref.start()
    try:
        await spec.start()
        try:
            yield ref.base_url, spec.base_url
        finally:
            await spec.stop()
    finally:
        await ref.stop()


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


# -- rejected drafts: where they happened, and proof that each was a near-tie ---------


@dataclass(frozen=True)
class Rejection:
    """The first draft token a verify round rejected."""

    round: int  # index of the round
    start: int  # generated tokens committed before the round
    n_accepted: int  # drafts the round accepted before this one
    position: int  # generated-token index the rejected draft stood at: start + n_accepted
    in_output: bool  # the server's own token there was committed (False: output ended first)


def rejections(rounds: Sequence[RoundRecord], n_tokens: int) -> list[Rejection]:
    """The rounds whose drafts were not all accepted, and at which generated position.

    Also checks that the rounds add up (greedy rule): a verify round commits at least
    one token, never more than its accepted drafts plus the server's own token, fewer
    only when the generation ended in it (so only in the last round), and the rounds'
    commits concatenate to the `n_tokens` generated tokens. A plain run (a record with
    `plain_run` set: the server decoded alone, nothing drafted) commits any number.
    """
    found: list[Rejection] = []
    start = 0
    for i, r in enumerate(rounds):
        where = f"round {i} (drafted {r.n_drafted}, accepted {r.n_accepted}, "
        where += f"committed {r.n_committed})"
        assert 0 <= r.n_accepted <= r.n_drafted, f"{where}: accepted more than drafted"
        if getattr(r, "plain_run", False):
            assert r.n_drafted == 0 and r.n_committed >= 1, f"{where}: not a plain run"
            start += r.n_committed
            continue
        assert 1 <= r.n_committed <= r.n_accepted + 1, f"{where}: commits do not add up"
        in_output = r.n_committed == r.n_accepted + 1
        if not in_output:
            assert i == len(rounds) - 1, f"{where}: ended early but is not the last round"
        if r.n_accepted < r.n_drafted:
            found.append(Rejection(i, start, r.n_accepted, start + r.n_accepted, in_output))
        start += r.n_committed
    assert start == n_tokens, f"the rounds committed {start} tokens, the output has {n_tokens}"
    return found


def implied_rounds(n_tokens: int, k: int, rejected_at: Sequence[int]) -> list[tuple[int, int, int]]:
    """(drafted, accepted, committed) of each round of a fixed-length greedy generation
    of `n_tokens` tokens (ended by its token limit, with room in the context) where the
    drafter agrees with the server everywhere but at the generated positions
    `rejected_at`: each round drafts min(k, tokens left - 1) and commits its accepted
    drafts plus the server's own token. A position that is some round's bonus token
    (the server's token after its last draft) is never drafted, so it changes nothing.
    """
    rejected = set(rejected_at)
    out: list[tuple[int, int, int]] = []
    position = 0
    while position < n_tokens:
        n_drafted = max(0, min(k, n_tokens - position - 1))
        n_accepted = next((i for i in range(n_drafted) if position + i in rejected), n_drafted)
        out.append((n_drafted, n_accepted, n_accepted + 1))
        position += n_accepted + 1
    return out


async def assert_rejections_are_near_ties(
    http: aiohttp.ClientSession,
    ref_url: str,
    prompt: Sequence[int],
    tokens: Sequence[int],
    rounds: Sequence[RoundRecord],
    drafts: Mapping[int, Sequence[int]] | None = None,
) -> list[Rejection]:
    """Assert that every draft rejection in `rounds` happened at a proven near-tie:
    the reference server's top-2 logits after the context the round verified are
    within NEAR_TIE_LOGIT_GAP, and the server's own token there (when it was
    committed) is one of them. Returns the rejections (none: nothing is asked).

    A RoundRecord holds counts only, not the draft tokens: with `drafts` (what a
    RecordingDrafter kept, by context length) the rejected draft token itself must be
    one of the top-2 too; without them only the gap (and the server's token) can be
    asserted, and a rejection after the output ended cannot be placed at all.
    """
    found = rejections(rounds, len(tokens))
    for r in found:
        record = rounds[r.round]
        where = f"round {r.round}: draft {r.n_accepted} of {record.n_drafted} rejected at "
        where += f"generated position {r.position}"
        accepted = list(tokens[r.start : r.position])
        candidates: set[int] = set()
        if r.in_output:
            candidates.add(tokens[r.position])  # the server's own token
        if drafts is not None:
            key = len(prompt) + r.start
            assert key in drafts, f"{where}: no draft was recorded after {key} tokens"
            draft = list(drafts[key])
            assert len(draft) >= record.n_drafted, f"{where}: recorded draft {draft} too short"
            committed = list(tokens[r.start : r.start + min(r.n_accepted, record.n_committed)])
            assert draft[: len(committed)] == committed, (
                f"{where}: recorded draft {draft} does not match the committed {committed}"
            )
            accepted = draft[: r.n_accepted]
            rejected = draft[r.n_accepted]
            assert rejected not in candidates, f"{where}: the draft {rejected} equals the output"
            candidates.add(rejected)
        else:
            assert r.in_output, (
                f"{where}, after the output ended: without the drafts its context is unknown"
            )
        ids, gap = await top2_gap(http, ref_url, [*prompt, *tokens[: r.start], *accepted])
        assert candidates <= set(ids) and gap < NEAR_TIE_LOGIT_GAP, (
            f"{where}: candidates {sorted(candidates)}, llama-server's top-2 {ids} with logit "
            f"gap {gap:.4f} (near-tie below {NEAR_TIE_LOGIT_GAP}): not a proven near-tie"
        )
    return found


class RecordingDrafter(DrafterBase):
    """A drafter that keeps each draft it hands out, keyed by the length of the
    context it followed (distinct for every round of one generation)."""

    early_draft = True  # its own `draft`, whatever the inner one drafts with

    def __init__(self, inner: AsyncDrafter, drafts: dict[int, list[int]]) -> None:
        self._inner = inner
        self.drafts = drafts

    @property
    def draft_ahead(self) -> bool:  # type: ignore[override]
        return self._inner.draft_ahead

    async def draft(
        self, committed: Sequence[int], k_max: int, worth: StopRule, *k_fresh: int
    ) -> GreedyDraft:
        out = await self._inner.draft(committed, k_max, worth, *k_fresh)
        self.drafts[len(committed)] = list(out.tokens)
        return out

    async def extend(self, n_max: int, cancel: Any, *lines: Any) -> int:
        return await self._inner.extend(n_max, cancel, *lines)

    async def draft_sampled(self, committed: Sequence[int], k: int, sampling: Any, rng: Any):
        return await self._inner.draft_sampled(committed, k, sampling, rng)

    async def propose(self, committed: Sequence[int], k: int) -> list[int]:
        tokens = list(await self._inner.propose(committed, k))
        self.drafts[len(committed)] = list(tokens)
        return tokens

    async def close(self) -> None:
        await self._inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else: as the inner one
        return getattr(self._inner, name)


def recording(
    opener: Callable[[], AsyncDrafter], drafts: dict[int, list[int]]
) -> Callable[[], AsyncDrafter]:
    """A drafter factory whose sessions record into `drafts` (one generation's worth)."""
    return lambda: RecordingDrafter(opener(), drafts)


def record_rounds(observer: Any) -> list[RoundRecord]:
    """Every RoundRecord `observer` (a proxy's ProxyMetrics) is given from now on, in
    order; the observer still gets each one."""
    records: list[RoundRecord] = []
    observe = observer.observe_round

    def tee(record: RoundRecord) -> None:
        records.append(record)
        observe(record)

    observer.observe_round = tee
    return records


async def generate(
    upstream: UpstreamClient,
    prompt: list[int],
    params: GenerationParams,
    drafter: AsyncDrafter | None,
    **options: Any,
) -> tuple[list[int], GenerationResult]:
    """Run the engine directly (no HTTP front): the tokens it yields and its result."""
    props = await upstream.props()
    generation = Generation(
        upstream, prompt, params, n_ctx=props["default_generation_settings"]["n_ctx"],
        drafter=drafter, pieces=PieceCache(upstream), **options,
    )  # fmt: skip
    tokens = [event.token async for event in generation.run()]
    assert generation.result is not None
    if generation.releasing is not None:  # the slots it empties in the background
        await generation.releasing
    return tokens, generation.result
