"""Draft sessions' KV caches, kept for later sessions where decode steps are graphs.

A slot is one sequence's cache: one buffer per layer for keys and one for values,
shaped [1, kv_heads, max_context, head_dim], bound as both past and present (see
`npu_draft.onnx_runner`), and, where steps replay CUDA graphs, its `DecodeGraph`.

A captured graph holds its slot's addresses, and ONNX Runtime can neither drop nor
re-point one; it keeps them per thread. So with graphs a closed session's slot goes
back to the pool and the next session takes it, preferring a slot already used on its
own thread (whose graph is captured there). There are then as many slots as sessions
were ever open at once, as there are worker threads (`npu_draft.async_session`).
Without graphs every session gets a new slot and frees it at close, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import onnxruntime as ort

from npu_draft.decode_graph import DecodeGraph


@dataclass
class KvSlot:
    cache: list[ort.OrtValue]  # keys and values, layer by layer
    binding: ort.IOBinding  # prompt chunks: the cache bound, inputs bound per run
    graph: DecodeGraph | None = None
    threads: set[int] = field(default_factory=set)  # threads that ran its graph


class SlotPool:
    """Slots lent to sessions; with `keep`, taken back at close and lent again."""

    def __init__(self, make: Callable[[bool], KvSlot], *, keep: bool) -> None:
        self._make = make
        self._keep = keep
        self._idle: list[KvSlot] = []
        self._lock = threading.Lock()
        self._cleared = False
        self.created = 0

    def take(self, graphed: bool) -> KvSlot:
        """A slot for the calling thread's session (`graphed`: with its decode graph)."""
        if graphed and self._keep:
            thread = threading.get_ident()
            with self._lock:
                if self._idle:
                    mine = [s for s in self._idle if thread in s.threads]
                    slot = (mine or self._idle)[-1]
                    self._idle.remove(slot)
                    slot.threads.add(thread)
                    return slot
        slot = self._make(graphed)
        with self._lock:
            self.created += 1
        if slot.graph is not None:
            slot.threads.add(threading.get_ident())
        return slot

    def give_back(self, slot: KvSlot) -> None:
        """At a session's close; a slot without a graph, or after `clear`, is dropped
        (its memory freed)."""
        with self._lock:
            if self._keep and slot.graph is not None and not self._cleared:
                self._idle.append(slot)

    def clear(self) -> None:
        """At the model's close: drop the idle slots, and those given back later."""
        with self._lock:
            self._cleared = True
            self._idle.clear()
