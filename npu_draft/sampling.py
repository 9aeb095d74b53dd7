"""Draft-side token choice: greedy, or the target's sampling chain mirrored.

For lossless speculative sampling the draft's distribution q can be anything the
draft token was really drawn from; mirroring llama.cpp's chain (top_k, top_p,
min_p, temperature) makes q close to the target's p, which is what raises
acceptance.
"""

from __future__ import annotations

import numpy as np

from npu_draft.protocol import Draft, SamplingParams, SparseDist

# top_p needs the candidates sorted by logit; sorting the whole 152k vocabulary
# is slow (docs/BENCHMARKS.md), so look at the best few thousand first and sort more only if the
# nucleus is wider than that.
_NUCLEUS_FIRST_LOOK = 4096


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.asarray(logits, dtype=np.float64) - np.max(logits)
    weights = np.exp(shifted)
    return weights / weights.sum()


def greedy_choice(logits: np.ndarray) -> tuple[int, float]:
    """The argmax token and its plain softmax probability (temperature 1)."""
    token = int(np.argmax(logits))
    weights = np.exp(np.asarray(logits, dtype=np.float64) - float(logits[token]))
    return token, 1.0 / float(weights.sum())


def runner_up(logits: np.ndarray, token: int) -> int:
    """The best token after `token` (the argmax) in `logits`."""
    if logits.shape[0] < 2:
        return token
    if not logits.flags.writeable:
        top2 = np.argpartition(logits, -2)[-2:]
        return int(top2[0] if int(top2[1]) == token else top2[1])
    best = logits[token]
    logits[token] = -np.inf  # restored below: one more argmax, no sort of the vocabulary
    try:
        return int(np.argmax(logits))
    finally:
        logits[token] = best


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> SparseDist:
    """The distribution left after llama.cpp's top_k -> top_p -> min_p -> temperature."""
    logits = np.asarray(logits, dtype=np.float64)
    vocab = logits.shape[0]
    if params.greedy:
        token = int(np.argmax(logits))
        return SparseDist(np.array([token], dtype=np.int64), np.array([1.0]))

    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    if 0.0 < params.top_p < 1.0:
        ids = _nucleus(logits, top_k, params.top_p)
    elif top_k < vocab:
        ids = np.argpartition(-logits, top_k - 1)[:top_k]
    else:
        ids = np.arange(vocab)
    cand = logits[ids]
    if params.min_p > 0.0:
        kept = cand >= cand.max() + np.log(params.min_p)
        ids, cand = ids[kept], cand[kept]
    probs = softmax(cand / params.temperature)
    return SparseDist(ids.astype(np.int64), probs)


def _sorted_top(logits: np.ndarray, limit: int) -> np.ndarray:
    """Ids of the `limit` largest logits, by descending logit."""
    if limit < logits.shape[0]:
        part = np.argpartition(-logits, limit - 1)[:limit]
        return part[np.argsort(-logits[part], kind="stable")]
    return np.argsort(-logits, kind="stable")


def _nucleus(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The top_k survivors, best first, cut after the token whose cumulative
    probability reaches top_p."""
    vocab = logits.shape[0]
    best = float(logits.max())
    # Probabilities are relative to every top_k survivor, not just those looked at.
    survivors = logits if top_k == vocab else logits[np.argpartition(-logits, top_k - 1)[:top_k]]
    total = np.exp(survivors - best).sum()
    ids = _sorted_top(logits, min(top_k, _NUCLEUS_FIRST_LOOK))
    cum = np.cumsum(np.exp(logits[ids] - best) / total)
    if cum[-1] < top_p and len(ids) < top_k:  # nucleus wider than the first look
        ids = _sorted_top(logits, top_k)
        cum = np.cumsum(np.exp(logits[ids] - best) / total)
    keep = int(np.searchsorted(cum, top_p)) + 1  # the crossing token stays
    return ids[:keep]


def choose_token(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator | None,
) -> tuple[int, float, SparseDist | None]:
    """(token, its draft probability, the draft distribution in sampling mode)."""
    if params.greedy:
        token, prob = greedy_choice(logits)
        return token, prob, None
    dist = sampling_distribution(logits, params)
    generator = rng if rng is not None else np.random.default_rng()
    index = int(generator.choice(len(dist.ids), p=dist.probs))
    return int(dist.ids[index]), float(dist.probs[index]), dist


def draft_next(
    draft: Draft, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None
) -> int:
    """Choose the token after `logits` and append it to `draft` with its probability
    and its runner-up (greedy) or its distribution (sampling)."""
    if params.greedy:
        token, prob = greedy_choice(logits)
        draft.runner_ups.append(runner_up(logits, token))
    else:
        token, prob, dist = choose_token(logits, params, rng)
        if draft.dists is not None and dist is not None:
            draft.dists.append(dist)
    draft.tokens.append(token)
    draft.probs.append(prob)
    return token
