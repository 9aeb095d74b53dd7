"""`npu-spec bench`: plain vs builtin drafting vs the proxy vs the oracle drafter.

A thin wrapper: the options and the session live in `proxy.bench`.
"""

from __future__ import annotations

from proxy.bench.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
