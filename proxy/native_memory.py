"""glibc's free arena memory handed back to the system (`malloc_trim(0)`).

Native buffers the proxy frees (a replaced drafter model's tensors, a failed draft
session's buffers, the responses of requests a killed llama-server cut off) do not
lower its RSS by themselves: what glibc took from its arenas for them (blocks under
its mmap threshold, which rises to 32 MiB as large blocks are freed) stays resident as
free arena space, spread over many arenas (a worker thread per draft session): 17-43
MiB at a time in the 2-core soak. So the proxy trims at the moments such buffers were
just freed: after a drafter load, re-creation or a replaced model's release, and after
a managed llama-server's restart.

What trimming cannot give back is the arenas' fragmentation: partly used pages that
grow with reloads. Pinning glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_=131072) keeps
the RSS flat but makes every draft step map and fault its buffers afresh (markedly
slower drafts on the 2-core machine), so it is the operator's choice, not made here;
docs/RELIABILITY.md, "Soak under faults". Elsewhere than glibc (musl, macOS, Windows)
every call here does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` from the running process's own C library, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # musl has no such symbol: AttributeError
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim() -> float:
    """Blocking: give every arena's free memory back; the ms it took (0.0 without
    glibc). Tens of ms on a few hundred MiB of heap, and it locks each arena in turn,
    so from the event loop use `trim_soon`."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return 0.0
    started = time.perf_counter()
    malloc_trim(0)
    return (time.perf_counter() - started) * 1e3


class _Trimmer:
    """One trim at a time, on a thread of its own; a request that comes while one
    runs makes it trim once more after (what was freed meanwhile), never queue more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False
        self._again: str | None = None

    def soon(self, why: str) -> None:
        if _malloc_trim() is None:
            return
        with self._lock:
            if self._running:
                self._again = why
                return
            self._running = True
        # a thread, not the loop's executor: a weakref finalizer may call this where
        # no event loop runs
        thread = threading.Thread(target=self._run, args=(why,), name="npu-heap-trim", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # the interpreter is shutting down: nothing left to save
            with self._lock:
                self._running, self._again = False, None

    def _run(self, why: str) -> None:
        while True:
            try:
                log.info("%s: free heap trimmed in %.0f ms", why, trim())
            except Exception:  # only ever an optimisation: never let it end the proxy
                log.exception("malloc_trim failed")
            with self._lock:
                if self._again is None:
                    self._running = False
                    return
                why, self._again = self._again, None


_trimmer = _Trimmer()


def trim_soon(why: str) -> None:
    """Trim on a background thread (at once, or right after a trim already running);
    `why` goes into the log line with the ms it took. Safe from any thread."""
    _trimmer.soon(why)


__all__ = ["trim", "trim_soon"]
