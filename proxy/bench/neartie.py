"""Proving a divergence is a near-tie: the target's top-2 logit gap where it happened.

Greedy output through the proxy must equal llama-server alone token for token. On a
GPU the batch shape of a request changes which kernels run and the float summation
order, which can flip the argmax between two candidates whose logits are nearly
equal. A run that differs is only excused when the server's own top-2 at the first
differing position are both candidates and their logit gap is below the margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

# Logit gap under which two candidates count as tied: batch layout changes the float
# summation order, which can flip only such a pair.
NEAR_TIE_LOGIT_GAP = 0.02


async def top2_gap(
    session: aiohttp.ClientSession, server_url: str, context: Sequence[int]
) -> tuple[list[int], float]:
    """(top-2 ids, logit gap) of a llama-server after `context` (greedy, one token)."""
    body = {"prompt": list(context), "n_predict": 1, "n_probs": 2, "temperature": 0.0}
    async with session.post(server_url + "/completion", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"top-2 probe: HTTP {response.status}: {await response.text()}")
        payload = await response.json()
    top = payload["completion_probabilities"][0]["top_logprobs"]
    return [t["id"] for t in top], top[0]["logprob"] - top[1]["logprob"]  # log-softmax gap


async def explain_mismatch(
    session: aiohttp.ClientSession,
    server_url: str,
    prompt: Sequence[int],
    reference: Sequence[int],
    got: Sequence[int],
    position: int,
    margin: float = NEAR_TIE_LOGIT_GAP,
) -> dict[str, Any]:
    """What the server says about the first position where `got` left `reference`."""
    ids, gap = await top2_gap(session, server_url, [*prompt, *reference[:position]])
    pair = {reference[position]} | ({got[position]} if position < len(got) else set())
    return {
        "position": position,
        "top2": ids,
        "logit_gap": gap,
        "near_tie": position < len(got) and pair <= set(ids) and gap < margin,
    }
