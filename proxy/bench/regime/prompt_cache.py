"""llama-server's RAM prompt cache (`--cache-ram`, on by default in b11434).

When a completion task takes a slot chosen by least-recent use (not by prefix
similarity), the server first copies the slot's cached prompt into host memory, then
looks for a cached prompt that suits the new task better and copies it back into the
slot (server_prompt_cache::alloc and ::load in tools/server/server-task.cpp). Both
copies run on the server's thread, before the batch that takes the task, so a plain
user's new conversation pays for saving the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.bench.regime.regime_file import SlotCost

KEEP_AT_LEAST = 0.25  # "don't trash large prompts": a state keeps >= this share


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by slice comparisons (C speed: the server compares
    every idle slot's cache with every prompt, thousands of tokens each)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class PromptCache:
    """The saved prompts, oldest first, and what moving them costs (no size limit:
    the regime files do not give a state's bytes per token)."""

    def __init__(self, cost: SlotCost) -> None:
        self.cost = cost
        self.states: list[list[int]] = []

    def save(self, cached: Sequence[int]) -> float:
        """prompt_save: keep a copy of a slot's cache; returns the charge in ms."""
        if not cached:
            return 0.0
        if any(common_prefix(s, cached) == len(cached) for s in self.states):
            return 0.0  # already held (alloc skips it before copying)
        self.states = [s for s in self.states if common_prefix(s, cached) != len(s)]
        self.states.append(list(cached))
        rate = self.cost.prompt_cache_save_ms_per_ktoken
        return (self.cost.save_ms_per_ktoken if rate is None else rate) * len(cached) / 1e3

    def load(self, cached: Sequence[int], prompt: Sequence[int]) -> tuple[list[int] | None, float]:
        """prompt_load: the saved prompt that keeps more of itself and covers more of
        `prompt` than the slot's own cache does (it leaves the cache), and its charge."""
        lcp = common_prefix(cached, prompt)
        keep_best = lcp / len(cached) if cached else -1.0
        sim_best = lcp / max(len(prompt), 1)
        best = None
        for state in self.states:
            lcp = common_prefix(state, prompt)
            keep, sim = lcp / len(state), lcp / max(len(prompt), 1)
            if keep < KEEP_AT_LEAST:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, state
        if best is None:
            return None, 0.0
        self.states.remove(best)
        return best, self.cost.restore_ms_per_ktoken * len(best) / 1e3
