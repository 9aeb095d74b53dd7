"""Near-tie branches of a reference: what the target writes after a flipped tie.

On a GPU the batch shape of a verify round can flip the argmax where the target's
top-2 logits are nearly equal (proxy.bench.neartie). From such a flip on, the output
is no longer the plain reference, and an oracle that only knows the reference drafts
nothing. So the bench's reference phase finds the reference's near-ties (the top-2 of
every position, from one greedy request with n_probs) and records, for the smallest
gaps, the greedy continuation after the runner-up: the path the target takes when it
flips there (npu_draft.oracle follows it). Plain requests, outside any timed
measurement.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from npu_draft.oracle import Branch
from proxy.bench.client import completion_body, exact_tokens

log = logging.getLogger(__name__)

# Branches recorded per reference by default: the flips a run shows are a few per answer
# (issue 28: 2-5 of 6 400-token answers differed, each once), at the smallest gaps.
DEFAULT_BRANCHES = 4


@dataclass(frozen=True)
class BranchPoint:
    position: int  # index into the continuation (a sub-branch: into its branch's)
    runner_up: int
    gap: float  # top-2 logit gap there
    within: int | None = None  # a sub-branch: where the branch it leaves forks


async def greedy_top2(
    session: aiohttp.ClientSession, base_url: str, prompt: Sequence[int], n_predict: int
) -> tuple[list[int], list[tuple[list[int], float]]]:
    """A greedy continuation (non-streamed) and, per position, its top-2 ids and their
    logit gap (log-softmax, as neartie.top2_gap measures it)."""
    body = {**completion_body(list(prompt), n_predict, stream=False), "n_probs": 2}
    async with session.post(base_url + "/completion", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"/completion answered {response.status}: {await response.text()}")
        payload = await response.json()
    tokens = [int(t) for t in payload["tokens"]]
    top2 = []
    for entry in payload.get("completion_probabilities") or []:
        top = entry["top_logprobs"]
        if len(top) < 2:
            break
        top2.append(([int(t["id"]) for t in top[:2]], top[0]["logprob"] - top[1]["logprob"]))
    return tokens, top2


def pick_branch_points(
    continuation: Sequence[int], top2: Sequence[tuple[list[int], float]], margin: float, limit: int
) -> list[BranchPoint]:
    """The near-ties of `continuation` (its token among the top-2, gap < margin), at most
    `limit` of them, smallest gap first."""
    points = []
    for position, (ids, gap) in enumerate(top2[: len(continuation)]):
        token = continuation[position]
        if gap < margin and token in ids and len(set(ids)) == 2:
            runner_up = ids[1] if ids[0] == token else ids[0]
            points.append(BranchPoint(position, runner_up, gap))
    points.sort(key=lambda p: (p.gap, p.position))
    return points[: max(limit, 0)]


async def record_branches(
    session: aiohttp.ClientSession, base_url: str, prompt: Sequence[int],
    continuation: Sequence[int], n_predict: int, margin: float, limit: int,
    sub_limit: int = 0,
) -> tuple[list[Branch], list[BranchPoint]]:  # fmt: skip
    """The branches of one reference (`continuation`: its plain greedy output of
    `n_predict` tokens at most) and the points they leave it at. `sub_limit`: also, per
    branch, the continuations after the runner-up at its own closest near-ties (a run
    that flips a second tie stays on a recorded path), listed after the branches as
    branches of the reference that share their branch's fork (points with `within`)."""
    probed, top2 = await greedy_top2(session, base_url, prompt, n_predict)
    # positions where the probe wrote the reference (the same server: all, normally)
    same = next(
        (i for i, (a, b) in enumerate(zip(probed, continuation, strict=False)) if a != b),
        min(len(probed), len(continuation)),
    )
    if same < len(continuation):
        log.warning("near-tie probe left the reference at %d of %d", same, len(continuation))
    points = pick_branch_points(continuation[:same], top2, margin, limit)
    branches, subs, sub_points = [], [], []
    for point in points:
        left = n_predict - point.position - 1  # the branch ends where the reference would
        context = [*prompt, *continuation[: point.position], point.runner_up]
        after = await exact_tokens(session, base_url, context, left) if left > 0 else []
        branches.append(Branch(point.position, point.runner_up, tuple(after)))
        if sub_limit <= 0 or not after:
            continue
        _, top2 = await greedy_top2(session, base_url, context, len(after))
        for sub in pick_branch_points(after, top2, margin, sub_limit):
            rest = left - sub.position - 1
            fork = [*context, *after[: sub.position], sub.runner_up]
            tail = await exact_tokens(session, base_url, fork, rest) if rest > 0 else []
            path = (*after[: sub.position], sub.runner_up, *tail)
            subs.append(Branch(point.position, point.runner_up, path))
            sub_points.append(BranchPoint(sub.position, sub.runner_up, sub.gap, point.position))
    return [*branches, *subs], [*points, *sub_points]
