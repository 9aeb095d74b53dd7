"""The server's slots, shared by every stream: admission, fairness, and speculation that
steps aside.

llama-server alone serves as many requests at once as it has slots (`-np`). The proxy
does the same: every generation request is a *stream* that needs one slot, and it is
admitted at once while fewer streams than slots are being served. Only when every slot
has a stream does a request wait, in one FIFO queue (no request overtakes another, so
none starves), bounded in length (`max_queue`: then `QueueFull`, a 503 with
Retry-After) and in time.

Speculation borrows the slots no stream needs: a speculative round of k drafts uses
k+1 slots, one of them the stream's own. Before each round a speculating stream asks
`grant` how many drafts it may verify: never more than the slots other streams leave
(split fairly between speculating streams), and, with other streams present, only
what the load gate (`proxy.policies.load`) measures to beat llama-server's own
batching of everyone. A grant of 0 makes the stream *yield*: it goes on by plain runs
(one slot, the server's own decoding loop, lossless) and speculates again (*resumes*)
when the load allows. A request admitted while others are served speculates only
where the gate allows it; otherwise it goes to llama-server whole (pass-through), which
is exactly what llama-server alone would do with it. A new request therefore never
waits for a speculative generation to finish: at most for the verify round in flight.

Slot files: each speculating stream gets a group number of its own, so two streams
never write the same slot-copy file.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from proxy.metrics import ConcurrencyMetrics
from proxy.policies.load import LoadGate
from proxy.scheduler import QueueFull, SchedulerBusy

__all__ = ["QueueFull", "SchedulerBusy", "SlotShare", "Stream", "StreamLease"]


@dataclass(eq=False)
class Stream:
    """One admitted generation request."""

    number: int
    arrived: float  # perf_counter
    speculative: bool = False  # served by the engine (else passed through whole)
    group: int = -1  # slot-file number of a speculative stream
    extra: int = 0  # slots granted beyond its own for the current round (= drafts)
    yielded: bool = False
    first_token_seen: bool = False


@dataclass
class _Waiter:
    future: asyncio.Future[Stream]
    stream: Stream


@dataclass
class SlotShare:
    total_slots: int
    group_size: int  # k + 1: what one speculative round of k drafts uses
    when_busy: Literal["queue", "passthrough"] = "queue"
    queue_timeout_s: float = 300.0
    max_queue: int | None = None  # None: unbounded (tests); the CLI always sets one
    max_streams: int | None = None  # None: one stream per server slot
    gate: LoadGate = field(default_factory=lambda: LoadGate("auto"))
    metrics: ConcurrencyMetrics = field(default_factory=ConcurrencyMetrics)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError("group size must be at least 1")
        self._streams: dict[int, Stream] = {}
        self._waiters: deque[_Waiter] = deque()
        self._numbers = 0
        self.events: deque[tuple[str, int]] = deque(maxlen=512)  # (what, stream number)
        self.max_seen_streams = 0

    # -- what the metrics and the old scheduler's readers see -------------------------

    @property
    def k_max(self) -> int:
        return self.group_size - 1

    @property
    def capacity(self) -> int:
        """Streams served at once before a request waits."""
        limit = self.total_slots if self.max_streams is None else self.max_streams
        return max(1, limit)

    @property
    def n_groups(self) -> int:
        """Speculative streams that could each verify k drafts at once, no other load."""
        return self.total_slots // self.group_size

    @property
    def streams(self) -> int:
        return len(self._streams)

    @property
    def active(self) -> int:
        """Streams on the speculative path (slot groups in the old scheduler's terms)."""
        return sum(1 for s in self._streams.values() if s.speculative)

    @property
    def speculating(self) -> int:
        return sum(1 for s in self._streams.values() if s.speculative and not s.yielded)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def rejected(self) -> int:
        return self.metrics.rejected

    def render_metrics(self) -> str:
        return self.metrics.render(self.streams, self.speculating, self.queued, self.total_slots)

    # -- admission ---------------------------------------------------------------------

    async def admit(self, wants_speculation: bool, arrived: float | None = None) -> Stream:
        """Admit one stream (at once, after waiting its turn, or QueueFull /
        SchedulerBusy); it says whether it speculates. Give it back with release().
        `arrived`: when the request came (perf_counter), for the first-token wait."""
        stream = Stream(self._next_number(), arrived or time.perf_counter())
        stream.speculative = wants_speculation  # decided when it is admitted
        if len(self._streams) < self.capacity and not self._waiters:
            return self._enter(stream)
        if self.when_busy == "passthrough":
            stream.speculative = False  # llama-server queues it, as it would alone
            return self._enter(stream, over=True)
        if self.max_queue is not None and self.queued >= self.max_queue:
            self.metrics.rejected += 1
            raise QueueFull(
                f"all {self.capacity} llama-server slots serve a stream and "
                f"{self.queued} requests are queued"
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future(), stream)
        self._waiters.append(waiter)
        self.events.append(("queued", stream.number))
        try:
            return await asyncio.wait_for(waiter.future, self.queue_timeout_s)
        except TimeoutError:
            self._abandon(waiter)
            raise SchedulerBusy(f"no slot free within {self.queue_timeout_s:.0f} s") from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def release(self, stream: Stream) -> None:
        if self._streams.pop(stream.number, None) is None:
            return
        self.events.append(("released", stream.number))
        while self._waiters and len(self._streams) < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(self._enter(waiter.stream))

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.future.result())  # admitted as it left: pass the place on
            return
        waiter.future.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _enter(self, stream: Stream, over: bool = False) -> Stream:
        self.metrics.admission_wait_ms.observe((time.perf_counter() - stream.arrived) * 1e3)
        if stream.speculative:
            n = len(self._streams) + 1
            m = self.active + 1
            free = self.total_slots - n - self._extra_of_others(stream)
            stream.speculative = not over and free >= 1 and self.gate.k_for(n, m, self.k_max) > 0
        if stream.speculative:
            taken = {s.group for s in self._streams.values() if s.speculative}
            stream.group = next(g for g in range(len(taken) + 1) if g not in taken)
        self._streams[stream.number] = stream
        self.max_seen_streams = max(self.max_seen_streams, len(self._streams))
        self.events.append(("speculative" if stream.speculative else "passthrough", stream.number))
        return stream

    def _next_number(self) -> int:
        self._numbers += 1
        return self._numbers

    def _extra_of_others(self, stream: Stream) -> int:
        return sum(s.extra for s in self._streams.values() if s is not stream)

    # -- speculation's share -----------------------------------------------------------

    def grant(self, stream: Stream) -> int:
        """The drafts `stream` may verify in its next round (0: yield, go on plainly)."""
        n = len(self._streams)
        m = max(self.active, 1)
        free = self.total_slots - n - self._extra_of_others(stream)
        fair = (self.total_slots - n) // m
        k = max(0, min(self.k_max, free, fair, self.gate.k_for(n, m, self.k_max)))
        stream.extra = k
        if k == 0 and not stream.yielded and n > 1:
            stream.yielded = True
            self.metrics.yields += 1
            self.events.append(("yield", stream.number))
        elif k > 0 and stream.yielded:
            stream.yielded = False
            self.metrics.resumes += 1
            self.events.append(("resume", stream.number))
        return k

    def hold(self, stream: Stream, extra: int) -> None:
        """The stream uses `extra` slots beyond its own this round (a plain run: 0)."""
        stream.extra = max(0, extra)

    def first_token(self, stream: Stream) -> None:
        if not stream.first_token_seen:
            stream.first_token_seen = True
            self.metrics.first_token_ms.observe((time.perf_counter() - stream.arrived) * 1e3)

    def lease(self, stream: Stream) -> StreamLease:
        return StreamLease(self, stream)

    def idle(self) -> bool:
        return not self._streams and not self._waiters


@dataclass
class StreamLease:
    """What a generation asks of the share before each round (`proxy.policies.Policies`)."""

    share: SlotShare
    stream: Stream

    def grant(self) -> int:
        return self.share.grant(self.stream)

    def hold(self, extra: int) -> None:
        self.share.hold(self.stream, extra)

    def alone(self) -> bool:
        return self.share.streams <= 1
