"""Counter arithmetic on parsed /metrics pages (parsed by `proxy.server.upstream`)."""

from __future__ import annotations

import re


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """after - before for every sample present after (a missing before counts as 0)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def per_position(values: dict[str, float], name: str) -> list[int]:
    """`name{position="i"}` samples as a list indexed by position."""
    found: dict[int, float] = {}
    pattern = re.compile(re.escape(name) + r'\{position="(\d+)"\}$')
    for key, value in values.items():
        match = pattern.match(key)
        if match:
            found[int(match.group(1))] = value
    if not found:
        return []
    return [round(found.get(i, 0.0)) for i in range(max(found) + 1)]
