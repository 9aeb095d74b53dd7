"""Where verify rounds rejected drafts, and the near-tie proof the server tests ask of
each rejection. Against the CPU llama-server every reference draft is accepted, so
this arithmetic only runs there on GPU backends: it is checked here, without a server.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP
from proxy.engine import RoundRecord
from tests.proxy.helpers import (
    Rejection,
    assert_rejections_are_near_ties,
    implied_rounds,
    rejections,
)


def rounds_of(*shapes: tuple[int, int, int]) -> list[RoundRecord]:
    """RoundRecords from (drafted, accepted, committed)."""
    return [
        RoundRecord(d, a, c, draft_ms=0.0, verify_ms=0.0, overhead_ms=0.0) for d, a, c in shapes
    ]


def test_all_accepted_has_no_rejections() -> None:
    assert rejections(rounds_of((6, 6, 7), (6, 6, 7), (1, 1, 2)), 16) == []
    assert rejections(rounds_of((0, 0, 1), (4, 4, 5)), 6) == []  # a round without drafts


def test_rejection_position_is_commits_before_plus_accepted() -> None:
    found = rejections(rounds_of((6, 6, 7), (6, 2, 3), (6, 0, 1), (6, 6, 7)), 18)
    assert found == [
        Rejection(round=1, start=7, n_accepted=2, position=9, in_output=True),
        Rejection(round=2, start=10, n_accepted=0, position=10, in_output=True),
    ]


def test_first_round_rejection_at_the_first_token() -> None:
    assert rejections(rounds_of((3, 0, 1), (3, 3, 4)), 5) == [Rejection(0, 0, 0, 0, True)]


def test_rejection_after_the_output_ended() -> None:
    # the last round accepted 3 drafts, but the output ended (EOS, stop word) at its 2nd
    found = rejections(rounds_of((4, 4, 5), (4, 3, 2)), 7)
    assert found == [Rejection(round=1, start=5, n_accepted=3, position=8, in_output=False)]


def test_plain_runs_only_move_the_start() -> None:
    records = rounds_of((4, 4, 5), (0, 0, 16), (4, 1, 2))
    if not hasattr(records[1], "plain_run"):
        pytest.skip("this RoundRecord has no plain runs")
    records[1] = replace(records[1], plain_run=True)  # records are frozen
    assert rejections(records, 23) == [Rejection(2, 21, 1, 22, True)]


@pytest.mark.parametrize(
    ("shapes", "n_tokens", "why"),
    [
        (((6, 6, 7), (6, 6, 7)), 15, "committed 14 tokens"),
        (((3, 4, 5),), 5, "accepted more than drafted"),
        (((3, 1, 3),), 3, "commits do not add up"),
        (((3, 3, 0),), 0, "commits do not add up"),
        (((3, 3, 2), (3, 3, 4)), 6, "not the last round"),
    ],
)
def test_rounds_that_do_not_add_up_are_refused(shapes, n_tokens: int, why: str) -> None:
    with pytest.raises(AssertionError, match=why):
        rejections(rounds_of(*shapes), n_tokens)


def test_implied_rounds_all_accepted() -> None:
    # test_engine_one_decode_per_round: 30 tokens, k = 6, 7 per round, the last 2
    assert implied_rounds(30, 6, []) == [(6, 6, 7)] * 4 + [(1, 1, 2)]
    assert implied_rounds(1, 8, []) == [(0, 0, 1)]
    assert implied_rounds(7, 6, []) == [(6, 6, 7)]


def test_implied_rounds_with_rejections() -> None:
    assert implied_rounds(30, 6, [9]) == [(6, 6, 7), (6, 2, 3), (6, 6, 7), (6, 6, 7), (5, 5, 6)]
    assert implied_rounds(10, 6, [0, 1]) == [(6, 0, 1), (6, 0, 1), (6, 6, 7), (0, 0, 1)]
    # position 6 is round 1's bonus token (the server's own, never drafted)
    assert implied_rounds(14, 6, [6]) == implied_rounds(14, 6, []) == [(6, 6, 7), (6, 6, 7)]


@given(
    n_tokens=st.integers(1, 120),
    k=st.integers(1, 8),
    rejected_at=st.sets(st.integers(0, 130), max_size=12),
)
def test_rejections_of_implied_rounds_are_the_drafted_rejections(
    n_tokens: int, k: int, rejected_at: set[int]
) -> None:
    shapes = implied_rounds(n_tokens, k, sorted(rejected_at))
    found = rejections(rounds_of(*shapes), n_tokens)
    starts = [sum(c for _, _, c in shapes[:i]) for i in range(len(shapes))]
    drafted = {s + i for s, (d, _, _) in zip(starts, shapes, strict=True) for i in range(d)}
    # every rejection found is one asked for, and one asked for is found exactly when
    # some round drafted its position before an earlier rejection ended that round
    assert {r.position for r in found} <= rejected_at
    for r in found:
        assert r.start == starts[r.round] and r.in_output
    missed = rejected_at - {r.position for r in found}
    bonus = {s + d for s, (d, _, _) in zip(starts, shapes, strict=True)}
    assert all(p in bonus or p >= n_tokens for p in missed)
    assert {r.position for r in found} <= drafted


# -- the near-tie proof, against a fake llama-server's top-2 -----------------------------


class FakeServer:
    """Answers `/completion` top-2 probes from a table: context tuple -> [(id, logprob)]."""

    def __init__(self, top2: dict[tuple[int, ...], list[tuple[int, float]]]) -> None:
        self.top2 = top2
        self.asked: list[list[int]] = []

    def post(self, url: str, json: dict[str, Any]) -> FakeResponse:
        assert url == "http://ref/completion" and json["n_probs"] == 2
        self.asked.append(list(json["prompt"]))
        top = self.top2[tuple(json["prompt"])]
        probs = [{"id": i, "logprob": lp} for i, lp in top]
        return FakeResponse({"completion_probabilities": [{"top_logprobs": probs}]})


class FakeResponse:
    status = 200

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    async def __aenter__(self) -> FakeResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def json(self) -> dict[str, Any]:
        return self.payload


PROMPT = [1, 2]
# generated 10 11 12 13 14 15: round 0 drafted 3, accepted 3, committed 4; round 1
# drafted 3 [14, 99, 98], accepted 1, and the server wrote 15 where the draft had 99
TOKENS = [10, 11, 12, 13, 14, 15]
ROUNDS = ((3, 3, 4), (3, 1, 2))
DRAFTS = {2: [10, 11, 12], 6: [14, 99, 98]}
CONTEXT = (*PROMPT, 10, 11, 12, 13, 14)
TIE = NEAR_TIE_LOGIT_GAP / 2


async def prove(
    server: FakeServer,
    drafts: dict[int, list[int]] | None = DRAFTS,
    tokens: list[int] = TOKENS,
    rounds: tuple[tuple[int, int, int], ...] = ROUNDS,
) -> list[Rejection]:
    session: Any = server  # what top2_gap uses of an aiohttp session
    return await assert_rejections_are_near_ties(
        session, "http://ref", PROMPT, tokens, rounds_of(*rounds), drafts
    )


async def test_near_tie_with_both_candidates_passes() -> None:
    server = FakeServer({CONTEXT: [(15, -0.5), (99, -0.5 - TIE)]})
    found = await prove(server)
    assert [r.position for r in found] == [5]
    assert server.asked == [list(CONTEXT)]  # only the round that rejected is asked about


async def test_no_rejection_asks_nothing() -> None:
    server = FakeServer({})
    assert await prove(server, rounds=((3, 3, 4), (1, 1, 2))) == [] and server.asked == []


async def test_wide_gap_is_not_a_near_tie() -> None:
    server = FakeServer({CONTEXT: [(15, -0.1), (99, -0.1 - 2 * NEAR_TIE_LOGIT_GAP)]})
    with pytest.raises(AssertionError, match="not a proven near-tie"):
        await prove(server)


async def test_rejected_draft_outside_the_top2_fails() -> None:
    server = FakeServer({CONTEXT: [(15, -0.5), (77, -0.5 - TIE)]})
    with pytest.raises(AssertionError, match=r"candidates \[15, 99\]"):
        await prove(server)
    # without the drafts only the gap and the server's own token can be checked
    assert [r.position for r in await prove(server, drafts=None)] == [5]


async def test_servers_token_outside_the_top2_fails() -> None:
    server = FakeServer({CONTEXT: [(99, -0.5), (77, -0.5 - TIE)]})
    with pytest.raises(AssertionError, match="not a proven near-tie"):
        await prove(server, drafts=None)


async def test_recorded_drafts_must_match_the_output() -> None:
    server = FakeServer({CONTEXT: [(15, -0.5), (99, -0.5 - TIE)]})
    with pytest.raises(AssertionError, match="does not match the committed"):
        await prove(server, drafts={**DRAFTS, 6: [13, 99, 98]})
    with pytest.raises(AssertionError, match="equals the output"):
        await prove(server, drafts={**DRAFTS, 6: [14, 15, 98]})
    with pytest.raises(AssertionError, match="no draft was recorded after 6 tokens"):
        await prove(server, drafts={2: [10, 11, 12]})


async def test_rejection_after_the_output_needs_the_drafts() -> None:
    # round 1 accepted [14, 15] of [14, 15, 97], but the output ended at 14 (a stop word)
    tokens, rounds = TOKENS[:5], ((3, 3, 4), (3, 2, 1))
    context = (*CONTEXT, 15)  # the accepted drafts, not the output, are the context
    server = FakeServer({context: [(96, -0.5), (97, -0.5 - TIE)]})
    drafts = {2: [10, 11, 12], 6: [14, 15, 97]}
    found = await prove(server, drafts=drafts, tokens=tokens, rounds=rounds)
    assert found == [Rejection(1, 4, 2, 6, False)] and server.asked == [list(context)]
    with pytest.raises(AssertionError, match="after the output ended"):
        await prove(server, drafts=None, tokens=tokens, rounds=rounds)
