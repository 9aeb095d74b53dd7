"""The exponentially weighted running mean the policies and slot copies keep."""

from __future__ import annotations


def running_mean(old: float | None, new: float, weight: float) -> float:
    """`new` where nothing was measured yet, else `old` moved `weight` of the way to it."""
    return new if old is None else old + weight * (new - old)
