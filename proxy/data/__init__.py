"""Data the client, the engine, the policies and the API share, in a room of its own.

- `verify`: what the server answers a verify batch and a plain run.
- `sampling`: a sampling request the speculative path mirrors, and its bound.
- `records`: what a generation reports: one frozen record per round, its result, and
  the metrics sink.

These modules import nothing of the proxy: everything above imports them downward.
"""
