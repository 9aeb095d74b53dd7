"""llama-server's slot loop (tools/server/server-context.cpp, update_slots), emulated.

One coroutine plays the server's main thread: it gives queued tasks to idle slots,
builds one batch from every busy slot (one token per generating slot, then prompt
tokens of the slots still ingesting, up to n_batch), places the batch's micro-batches
in the KV pool, sleeps what the regime charges for them, and then samples, streams and
finishes. Requests arriving meanwhile join at the next batch, as in the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.bench.regime.kv_pool import KvPool
from proxy.bench.regime.prompt_cache import PromptCache, common_prefix
from proxy.bench.regime.regime_file import Regime
from proxy.bench.regime.target import ScriptedTarget

log = logging.getLogger(__name__)

TRACE = bool(os.environ.get("NPU_SPEC_REGIME_TRACE"))  # log every task's slot and cache
SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default
# asyncio's timers wake up to ~1 ms late (epoll's millisecond timeout); a batch that
# follows at once starts when the last charge ended, so lateness does not add up
CLOCK_SLACK_S = 0.002
# while slots stay busy the real server never waits between batches: a later wake-up
# of this process (another process had the CPU) is caught up, up to this much
BUSY_SLACK_S = 0.020


@dataclass(eq=False)
class Task:
    """One prompt of a request, served by one slot."""

    prompt: list[int]
    n_predict: int
    index: int = 0
    id_slot: int = -1  # asked for by the request; -1: any
    cache_prompt: bool = True
    on_token: Callable[[Task, int], None] | None = None  # streaming
    done: asyncio.Future[Task] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # filled in while served
    slot: int = -1
    n_cached: int = 0
    n_prompt_processed: int = 0
    generated: list[int] = field(default_factory=list)
    stop_type: str = "none"
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_end: float = 0.0
    cancelled: bool = False
    error: str | None = None

    @property
    def prompt_ms(self) -> float:
        return (self.t_prompt_done - self.t_start) * 1e3

    @property
    def predicted_ms(self) -> float:
        return (self.t_end - self.t_prompt_done) * 1e3


@dataclass(eq=False)
class Slot:
    id: int
    cache: list[int] = field(default_factory=list)  # tokens whose cells the pool holds
    task: Task | None = None
    todo: list[int] = field(default_factory=list)  # prompt tokens still to ingest
    pending: int | None = None  # sampled, not yet decoded
    t_last_used: float = -1.0  # set only when a task releases the slot
    id_task: int = -1  # the last task launched here (/slots keeps it once the slot is idle)

    @property
    def busy(self) -> bool:
        return self.task is not None


@dataclass
class Counters:
    """What /metrics reports (llamacpp:*)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    prompt_cached: int = 0
    n_decode: int = 0
    n_busy_slots: int = 0  # summed per decode
    n_tokens_max: int = 0


class RegimeEngine:
    def __init__(
        self,
        regime: Regime,
        target: ScriptedTarget,
        n_slots: int,
        n_ctx: int,
        unified: bool,
        n_batch: int = 2048,
        n_ctx_slot: int | None = None,
        prompt_cache: bool = True,
    ) -> None:
        self.regime = regime
        # --cache-ram (on unless -cram 0): a slot taken by least-recent use saves its
        # prompt to host memory first
        self.prompt_cache = PromptCache(regime.slots) if prompt_cache else None
        self.target = target
        self.n_ctx = n_ctx
        self.unified = unified
        self.n_batch = n_batch
        # with -kvu every slot may grow to the whole pool; else each has its share
        self.n_ctx_slot = n_ctx_slot or (n_ctx if unified else max(n_ctx // n_slots, 1))
        self.slots = [Slot(i) for i in range(n_slots)]
        self.pool = KvPool(n_ctx, n_slots, unified)
        self._shapes = ShapeHistory()  # the regime's new-shape charge (`new_shape_ms`)
        self.queue: deque[Task] = deque()
        self.deferred_tasks: deque[Task] = deque()  # waiting for a slot to be released
        self.counters = Counters()
        self._task_ids = itertools.count()  # the server's task ids only grow
        self.charged_ms = 0.0  # every decode's charge, summed (the clock benchmark)
        self._wake = asyncio.Event()
        self._exclusive = asyncio.Lock()  # the server's one thread: a batch or a slot action
        self._clock_end = 0.0  # when the last charge ends (perf_counter seconds)
        self._launch_ms = 0.0  # the server thread's work on tasks started since the last batch
        self._still_busy = False  # slots stayed busy after the last batch
        self._runner: asyncio.Task[None] | None = None

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner

    def submit(self, tasks: Sequence[Task]) -> None:
        """Queue a request's tasks together (the server posts them atomically)."""
        self.queue.extend(tasks)
        self._wake.set()

    def cancel(self, task: Task) -> None:
        """The client went away: the slot stops at its next batch."""
        task.cancelled = True
        for waiting in (self.queue, self.deferred_tasks):
            if task in waiting:
                waiting.remove(task)
                if not task.done.done():
                    task.done.set_result(task)
        self._wake.set()

    @property
    def deferred(self) -> int:
        return len(self.deferred_tasks)

    @property
    def processing(self) -> int:
        return sum(slot.busy for slot in self.slots)

    # -- slot actions (server thread: between batches) ------------------------------

    async def run_exclusive(
        self, work: Callable[[], Any], charge_ms: Callable[[Any], float]
    ) -> Any:
        """A slot action: done between batches (the server's one thread), charged on
        the same clock."""
        async with self._exclusive:
            started = self._batch_start()
            result = work()
            self._clock_end = started + max(0.0, charge_ms(result)) / 1e3
            await _sleep_until(self._clock_end)
            return result

    def set_cache(self, slot: Slot, tokens: list[int]) -> None:
        """Restore: the slot's cache becomes `tokens` (its old cells are freed first)."""
        self.pool.remove(slot.id, 0)
        slot.cache = []
        if tokens:
            self.pool.add(slot.id, 0, len(tokens))
        slot.cache = list(tokens)

    def erase(self, slot: Slot) -> int:
        n = len(slot.cache)
        self.pool.remove(slot.id, 0)
        slot.cache = []
        return n

    # -- the loop -----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.queue and not any(s.busy for s in self.slots):
                self._wake.clear()
                await self._wake.wait()
            async with self._exclusive:
                self._assign()
                batch = self._build_batch()
                if not batch:  # only cancelled tasks, or tasks waiting for a slot
                    self._finish_cancelled()
                    self._wake.clear()
                    if any(s.busy for s in self.slots) or not self.queue:
                        continue
                    await self._wake.wait()
                    continue
                started = self._batch_start()
                if not self._make_room(sum(len(tokens) for _, tokens in batch)):
                    self._fail("Context size has been exceeded.")
                    continue
                charge = self._place(batch)
                self.charged_ms += charge
                self._clock_end = started + charge / 1e3
                await _sleep_until(self._clock_end)
                self._after_decode(batch)
                self._still_busy = any(slot.busy for slot in self.slots)

    def _batch_start(self) -> float:
        """When this charge starts: right where the last one ended while the server
        stayed busy (a late wake-up of this process, up to CLOCK_SLACK_S, is not
        charged again), else now."""
        now = time.perf_counter()
        late = now - self._clock_end
        if late < CLOCK_SLACK_S or (self._still_busy and late < BUSY_SLACK_S):
            return self._clock_end
        return now

    def _assign(self) -> None:
        """Queued tasks, in order, take an idle slot; a task that finds none is
        deferred (server_queue: back of the deferred queue)."""
        while self.queue:
            task = self.queue.popleft()
            if task.cancelled:
                continue
            slot, update_cache = self._slot_for(task)
            if slot is None:
                self.deferred_tasks.append(task)
                continue
            if update_cache and self.prompt_cache is not None:
                self._swap_prompt(slot, task)
            self._launch(slot, task)

    def _swap_prompt(self, slot: Slot, task: Task) -> None:
        """The prompt cache's update: save the slot's prompt, then load a saved one that
        suits the task better (charged on the server thread before the next batch)."""
        assert self.prompt_cache is not None
        self._launch_ms += self.prompt_cache.save(slot.cache)
        loaded, charge = self.prompt_cache.load(slot.cache, task.prompt)
        if loaded is not None:
            self.set_cache(slot, loaded)
            self._launch_ms += charge

    def _slot_for(self, task: Task) -> tuple[Slot | None, bool]:
        """get_available_slot: the idle slot whose cache shares the largest part of the
        prompt (above the similarity threshold; ties: the lowest id), else the least
        recently released idle slot (ties: the highest id, so a fresh server fills its
        last slot first). The flag is the prompt cache's update_cache: the slot was
        chosen by least-recent use, or by similarity while keeping under half its cache."""
        idle = [s for s in self.slots if not s.busy]
        if task.id_slot >= 0:
            idle = [s for s in idle if s.id == task.id_slot % len(self.slots)]
            if not idle:
                return None, False
        best, best_sim, best_lcp = None, 0.0, 0
        for slot in idle:
            if not slot.cache:
                continue
            lcp = common_prefix(slot.cache, task.prompt)
            sim = lcp / max(len(task.prompt), 1)
            if sim > best_sim and sim > SLOT_PROMPT_SIMILARITY:
                best, best_sim, best_lcp = slot, sim, lcp
        if best is not None:
            return best, best_lcp / len(best.cache) < 0.5
        if task.id_slot >= 0:  # the asked-for slot, with no cache update
            return idle[0], False
        lru = None
        for slot in idle:
            if lru is None or slot.t_last_used <= lru.t_last_used:
                lru = slot
        return lru, lru is not None

    def _launch(self, slot: Slot, task: Task) -> None:
        n_past = common_prefix(slot.cache, task.prompt) if task.cache_prompt else 0
        if n_past == len(task.prompt):  # the last prompt token is evaluated again
            n_past -= 1
        self.pool.remove(slot.id, n_past)
        slot.cache = slot.cache[:n_past]
        slot.todo = list(task.prompt[n_past:])
        slot.task = task
        slot.id_task = next(self._task_ids)
        slot.pending = None
        task.slot = slot.id
        task.n_cached = n_past
        task.n_prompt_processed = len(slot.todo)
        task.t_start = time.perf_counter()
        if TRACE:
            log.info(
                "task %d: slot %d, prompt %d, cached %d, to ingest %d",
                task.index, slot.id, len(task.prompt), n_past, len(slot.todo),
            )  # fmt: skip
        self._launch_ms += self.regime.host.server_per_ktoken_ms * len(task.prompt) / 1e3

    def _build_batch(self) -> list[tuple[Slot, list[int]]]:
        """(slot, tokens to decode) in the server's order: generating slots' sampled
        tokens first, then prompt tokens slot by slot, up to n_batch in all."""
        batch: list[tuple[Slot, list[int]]] = []
        n = 0
        for slot in self.slots:
            if slot.busy and slot.pending is not None and not slot.task.cancelled:
                batch.append((slot, [slot.pending]))
                n += 1
        for slot in self.slots:
            if (
                not slot.busy
                or slot.pending is not None
                or slot.task.cancelled
                or n >= self.n_batch
            ):
                continue
            take = slot.todo[: self.n_batch - n]
            if take:
                batch.append((slot, take))
                n += len(take)
        return batch

    def _place(self, batch: list[tuple[Slot, list[int]]]) -> float:
        """Put the batch's tokens in the pool, micro-batch by micro-batch, and return
        what the regime charges for all of its decodes (ms)."""
        decode = self.regime.decode
        ubatch = decode.ubatch
        pieces: list[tuple[Slot, int, int]] = []  # slot, first position, tokens
        for slot, tokens in batch:
            pieces.append((slot, len(slot.cache), len(tokens)))
            slot.cache.extend(tokens)
        total_ms = 0.0
        if self.unified:
            groups = _chunks(pieces, ubatch)
        else:  # one stream per slot: the batch splits per sequence
            groups = [g for piece in pieces for g in _chunks([piece], ubatch)]
        shape = []
        for group in groups:
            for slot, first, n in group:
                self.pool.add(slot.id, first, n)
            n_tokens = sum(n for _, _, n in group)
            n_kv = max(self.pool.n_kv(slot.id) for slot, _, _ in group)
            total_ms += decode.ms(n_tokens, n_kv)
            shape.append((n_tokens, len(group), n_kv))
        sampling = sum(
            1 for slot, tokens in batch if slot.pending is not None or len(tokens) == len(slot.todo)
        )
        total_ms += decode.new_shape_ms * self._shapes.new(tuple(shape), sampling)
        total_ms += self.regime.host.per_extra_sample_ms * max(0, sampling - 1)
        total_ms += self._launch_ms
        self._launch_ms = 0.0
        self.counters.n_decode += 1
        self.counters.n_busy_slots += sum(s.busy for s in self.slots)
        self.counters.n_tokens_max = max(
            self.counters.n_tokens_max, max(len(s.cache) for s in self.slots)
        )
        return total_ms

    def _after_decode(self, batch: list[tuple[Slot, list[int]]]) -> None:
        now = time.perf_counter()
        for slot, tokens in batch:
            task = slot.task
            assert task is not None
            if slot.pending is not None:  # a generated token went in
                slot.pending = None
            else:
                slot.todo = slot.todo[len(tokens) :]
                if slot.todo:
                    continue  # more prompt next batch
                task.t_prompt_done = now
                self.counters.prompt_tokens += task.n_prompt_processed
                self.counters.prompt_cached += task.n_cached
                self.counters.prompt_seconds += task.prompt_ms / 1e3
            token = self.target.next_token(slot.cache)
            task.generated.append(token)
            if task.on_token is not None and not task.cancelled:
                task.on_token(task, token)
            if len(task.generated) >= task.n_predict or len(slot.cache) + 1 >= self.n_ctx_slot:
                task.stop_type = "limit"
                self._release(slot, now)
            else:
                slot.pending = token
        self._finish_cancelled()

    def _finish_cancelled(self) -> None:
        now = time.perf_counter()
        for slot in self.slots:
            if slot.busy and slot.task.cancelled:
                self._release(slot, now)

    def _release(self, slot: Slot, now: float) -> None:
        task = slot.task
        assert task is not None
        task.t_end = now
        if not task.t_prompt_done:
            task.t_prompt_done = now
        self.counters.predicted_tokens += len(task.generated)
        self.counters.predicted_seconds += task.predicted_ms / 1e3
        slot.task = None
        slot.todo = []
        slot.pending = None
        slot.t_last_used = now
        if self.deferred_tasks:  # pop_deferred_task: one task, to the front of the queue
            wanted = [t for t in self.deferred_tasks if t.id_slot == slot.id]
            moved = wanted[0] if wanted else self.deferred_tasks[0]
            self.deferred_tasks.remove(moved)
            self.queue.appendleft(moved)
        if not task.done.done():
            task.done.set_result(task)

    def _make_room(self, n_tokens: int) -> bool:
        """A batch that does not fit the pool purges idle slots' caches, the first by id
        first, until it does (try_clear_idle_slots; only with one unified stream)."""
        if not self.unified:
            return True  # each slot's stream holds n_ctx / np: checked per prompt
        while self.pool.free_cells() < n_tokens:
            full_idle = [s for s in self.slots if not s.busy and s.cache]
            if not full_idle:
                return False
            log.info("purging idle slot %d to make room for %d tokens", full_idle[0].id, n_tokens)
            self.erase(full_idle[0])
        return True

    def _fail(self, message: str) -> None:
        """Every processing slot fails with `message` and loses its cache."""
        now = time.perf_counter()
        for slot in self.slots:
            if slot.task is not None:
                slot.task.error = message
                self._release(slot, now)
                self.erase(slot)
        log.warning("%s", message)


class ShapeHistory:
    """Whether a decode replays: the third decode in a row of one shape (tokens,
    sequences and span of each micro-batch, and outputs) is the first that ggml's CUDA
    backend replays as a CUDA graph (the first runs it, the second captures it), and a
    decode of another shape starts over (b11434, ggml-cuda.cu: the graph warm-up)."""

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None
        self._warm = False

    def new(self, shape: tuple[Any, ...], outputs: int) -> int:
        """1 where this decode does not replay, else 0."""
        key = (shape, outputs)
        if key != self._last:
            self._last, self._warm = key, False
            return 1
        if not self._warm:
            self._warm = True
            return 1
        return 0


def _chunks(pieces: list[tuple[Any, int, int]], size: int) -> list[list[tuple[Any, int, int]]]:
    """Split (slot, first position, n) pieces, in order, into micro-batches of <= size
    tokens (llama_batch_allocr's simple split, as a unified cache uses)."""
    groups: list[list[tuple[Any, int, int]]] = [[]]
    room = size
    for slot, first, n in pieces:
        while n > 0:
            if room == 0:
                groups.append([])
                room = size
            take = min(n, room)
            groups[-1].append((slot, first, take))
            first += take
            n -= take
            room -= take
    return [g for g in groups if g]


def _new_future() -> asyncio.Future[Task]:
    return asyncio.get_running_loop().create_future()


class WakeUp:
    """Sleeps that end when they should on average: an event loop wakes up late (its
    timer rounds up to a millisecond, and other processes hold the CPU), so each sleep
    aims early by the running mean of how late the last ones woke."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.early_s = 0.0

    async def until(self, deadline: float) -> None:
        target = deadline - self.early_s
        delay = target - time.perf_counter()
        if delay <= 0:
            return
        await asyncio.sleep(delay)
        late = time.perf_counter() - target
        self.early_s += self.weight * (min(late, 0.005) - self.early_s)


WAKE_UP = WakeUp()  # one event loop per process: one measure of its lateness


async def _sleep_until(deadline: float) -> None:
    await WAKE_UP.until(deadline)
