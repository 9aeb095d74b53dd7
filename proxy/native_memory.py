"""glibc's heap kept from holding native memory the proxy has freed.

Native buffers the proxy frees (a replaced drafter model's tensors, a failed draft
session's buffers, the responses of requests a killed llama-server cut off) do not
lower its RSS by themselves, for two reasons, each with its remedy here:

- glibc's dynamic thresholds: it raises its mmap threshold to the size of every
  mmapped block freed (up to 32 MiB) and its trim threshold to twice that, so after
  the first load the large blocks of draft sessions (four of 8 MiB a session) and of
  later loads come from the arenas, where they fragment and stay
  (`scripts/rss_kill_probe.py --event reload --events 6`: the trimmed anonymous RSS
  +12 MiB, free arena space 50 to 104 MiB). `tune_malloc`, at the start of `serve`,
  fixes both (mmap threshold 4 MiB: blocks from there up get mmaps of their own,
  unmapped when freed, while a draft step's buffers, 0.6-2 MiB, still come from the
  arenas; trim threshold 8 MiB) and caps glibc at 2 arenas (a thread per draft
  session otherwise leaves free space in arenas of their own). The same probe: +4
  MiB, free arena space 8 to 20 MiB; the 30-minute soak +2.2%. Draft sessions: no
  change beyond the 2-core machine's noise (a few %); mapping the 8 MiB blocks
  afresh costs ~1 ms each, ~4% of a short session. The thresholds pinned at glibc's
  start value (128 KiB) also kept the RSS flat, but made drafts ~1.5x slower: every
  step's buffers were mapped afresh, and a trim threshold left at 128 KiB shrank the
  heap after every step.
- Freed blocks under the threshold stay resident as free arena space. `trim_soon`
  gives it back (`malloc_trim(0)`) at the moments such buffers were just freed: a
  drafter load, re-creation or a replaced model's release, a managed llama-server's
  restart.

docs/RELIABILITY.md, "Handing freed native memory back". Elsewhere than glibc (musl,
macOS, Windows) every call here does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
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


# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 4 << 20  # above a draft step's buffers, below a model's large blocks
TRIM_THRESHOLD = 8 << 20  # twice that, as glibc's own dynamic rule would set it
ARENA_MAX = 2
# what the operator sets these with: an environment variable, or GLIBC_TUNABLES
_THRESHOLDS = (
    ("MALLOC_MMAP_THRESHOLD_", "mmap_threshold"),
    ("MALLOC_TRIM_THRESHOLD_", "trim_threshold"),
)
_ARENAS = (("MALLOC_ARENA_MAX", "arena_max"),)


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    if _malloc_trim() is None:  # not glibc (musl has a mallopt that does nothing)
        return None
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def _operator_set(names: tuple[tuple[str, str], ...]) -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(
        variable in os.environ or f"glibc.malloc.{tunable}" in tunables
        for variable, tunable in names
    )


def tune_malloc() -> dict[str, int]:
    """Fix glibc's mmap and trim thresholds and cap its arenas (module docstring),
    each unless the operator set it: the two thresholds are left alone together if
    either is set (setting one stops glibc moving the other); what was set here, by
    mallopt's names. Call before the drafter loads; it does not reach llama-server."""
    mallopt = _mallopt()
    if mallopt is None:
        return {}
    wanted: list[tuple[str, int, int]] = []
    if not _operator_set(_THRESHOLDS):
        wanted += [
            ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        ]
    if not _operator_set(_ARENAS):
        wanted.append(("M_ARENA_MAX", M_ARENA_MAX, ARENA_MAX))
    done = {name: value for name, param, value in wanted if mallopt(param, value) == 1}
    if done:
        log.debug("glibc malloc: %s", ", ".join(f"{k}={v}" for k, v in done.items()))
    return done


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


__all__ = ["trim", "trim_soon", "tune_malloc"]
