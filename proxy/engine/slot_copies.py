"""Slot copies: a slot that holds the context, saved and restored into the slots the
rounds use, instead of each of them prefilling it inside a verify batch.

Only speed depends on them: a failed or skipped copy means those slots prefill in the
next verify batch, exactly as without copies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from npu_draft.protocol import common_prefix_length
from proxy.running_mean import running_mean
from proxy.server.upstream import UpstreamClient, UpstreamClientError, UpstreamError

log = logging.getLogger(__name__)

_PASSING = (503, 504)  # UpstreamError statuses of a failure worth trying again later
_RATE_ALPHA = 0.3  # weight of the newest measurement in the running rates


@dataclass
class CopyTimes:
    """One copy's wall times (ms): the save, and the restores (sent at once)."""

    save_ms: float = 0.0
    restore_ms: float = 0.0
    restored: int = 0

    def as_list(self) -> list[float | int]:
        return [round(self.save_ms, 2), round(self.restore_ms, 2), self.restored]


class SlotReplicator:
    """Cold start without k+1 prefills: after a first plain round prefilled one slot,
    save that slot server-side and restore it into k idle slots (a save and a restore
    cost far less than a prefill; docs/BENCHMARKS.md, "Measurements behind design
    choices")."""

    def __init__(
        self,
        upstream: UpstreamClient,
        min_prompt: int = 64,
        reuse_files: bool = True,
        clear_stale_copies: bool = True,
        copy_by_cost: bool = True,
    ) -> None:
        self.upstream = upstream
        self.min_prompt = min_prompt  # shorter prompts prefill in the batch just as well
        self.reuse_files = reuse_files  # False: every copy saves anew (`--slot-file-reuse`)
        self.clear_stale_copies = clear_stale_copies  # `--clear-stale-copies`
        self.copy_by_cost = copy_by_cost  # False: `copy_pays` always (`--copy-by-cost`)
        self.available = True  # False once the server refused (no --slot-save-path)
        # measured on this server, per context token: a slot save (the server's own
        # timing) and a one-slot prefill (a first round's); None until measured
        self.save_ms_per_token: float | None = None
        self.restore_ms_per_token: float | None = None  # (the server's timing too)
        self.prefill_ms_per_token: float | None = None
        # copies that ended generations left in slots, by slot: that generation's
        # context (a copy holds it or a prefix of it) and how many of its tokens the
        # slot holds; and the slots generations in flight use, with how many of them
        # (`clear_stale`)
        self.left_copies: dict[int, Sequence[int]] = {}
        self.left_holds: dict[int, int] = {}
        self.in_flight: Counter[int] = Counter()

    def worth_copying(self, n_fresh: int) -> bool:
        """Copy a slot only when its prefill would cost the others more than a copy."""
        return n_fresh >= self.min_prompt

    def observe_prefill(self, server_ms: float, n_tokens: int) -> None:
        """A one-slot prefill of `n_tokens` took `server_ms` inside the server."""
        if n_tokens >= self.min_prompt and server_ms > 0:
            self.prefill_ms_per_token = running_mean(
                self.prefill_ms_per_token, server_ms / n_tokens, _RATE_ALPHA
            )

    def reuse_pays(self, gap: int, copies: int, n_context: int) -> bool:
        """Whether restoring a file saved `gap` tokens ago, and letting `copies` slots
        prefill those tokens in the next verify batch, costs less than saving the whole
        context of `n_context` tokens anew first. On the H200 (14B f16) a save costs
        0.150 ms a token and a prefill 0.074 a token and slot, so at 4k a new save (0.6
        s) costs more than most gaps; on a CPU a save is nearly free and a prefill is
        not (docs/BENCHMARKS.md, "Measurements behind design choices"). Unmeasured
        rates: save."""
        save, prefill = self.save_ms_per_token, self.prefill_ms_per_token
        if not self.reuse_files or save is None or prefill is None or gap < 0:
            return False
        return gap * copies * prefill < n_context * save

    def copy_pays(self, lag: int, copies: int, n_context: int, restore_only: bool = False) -> bool:
        """Whether copying `n_context` tokens (a save, unless `restore_only`, and a
        restore into each of `copies` slots) costs less than letting those slots
        prefill the `lag` tokens they lack inside the next verify batch. A cold start
        lags by the whole context and copies wherever a save and a restore cost less
        than a prefill; a later turn whose slots hold most of the conversation may not:
        on an H100, slots that lagged ~300 tokens of a 934-token chat were copied for
        377 ms where prefilling the 300 in three slots takes ~100 (docs/BENCHMARKS.md,
        "`--pad-rounds auto` end to end"). On Strix Halo's Vulkan a prefill past the
        8-token edge costs ~4 ms a token and copies win. Unmeasured rates: copy."""
        save, restore = self.save_ms_per_token, self.restore_ms_per_token
        prefill = self.prefill_ms_per_token
        if not self.copy_by_cost or save is None or restore is None or prefill is None:
            return True
        copy_ms = (0.0 if restore_only else n_context * save) + copies * n_context * restore
        return copy_ms < copies * lag * prefill

    def refresh_pays(self, lag: int, n_context: int) -> bool:
        """Whether a slot that lags the context by `lag` tokens should get a fresh copy
        of the whole `n_context` before a batch uses it, rather than prefill what it
        lags by inside that batch. On Strix Halo's Vulkan a batch past 8 tokens prefills
        at ~4 ms a token against a save's ~0.15 (the regime file), so a slot left behind
        since the last longer round pays from a few dozen tokens on; on the H200 a save
        costs twice a prefill per token and the slot catches up in the batch. Unmeasured
        rates: no."""
        save, prefill = self.save_ms_per_token, self.prefill_ms_per_token
        if save is None or prefill is None or not self.worth_copying(lag):
            return False
        return lag * prefill > n_context * save

    async def replicate(
        self,
        id_slot: int,
        copies: int,
        filename: str,
        keep: Collection[int] = (),
        save: bool = True,
        into: Collection[int] | None = None,
        times: CopyTimes | None = None,
    ) -> list[int]:
        """Copy slot `id_slot` into up to `copies` idle slots, none of `keep` (only of
        `into` where given); returns the ids restored (nothing is saved where no slot
        is free). `save` False: restore `filename` as it is (saved earlier by the same
        generation). `times` gets the save's and the restores' wall times."""
        if not self.available or copies <= 0 or id_slot < 0:
            return []
        restored: list[int] = []
        try:
            slots = await self.upstream.slots()
            targets = [
                s["id"] for s in slots
                if not s.get("is_processing") and s["id"] != id_slot and s["id"] not in keep
                and (into is None or s["id"] in into)
            ][:copies]  # fmt: skip
            if not targets:
                return []
            started = time.perf_counter()
            if save:
                self._observe_save(await self.upstream.slot_action(id_slot, "save", filename))
            saved = time.perf_counter()
            # all at once: the server restores them one after another in its loop, and
            # no request waits for the last one's answer to travel back
            answers = await asyncio.gather(
                *(self.upstream.slot_action(target, "restore", filename) for target in targets),
                return_exceptions=True,
            )
            restored = [
                t for t, a in zip(targets, answers, strict=True) if not isinstance(a, BaseException)
            ]
            for answer in answers:
                if isinstance(answer, dict):
                    self._observe_restore(answer)
            if times is not None:
                times.save_ms = (saved - started) * 1e3 if save else 0.0
                times.restore_ms = (time.perf_counter() - saved) * 1e3
                times.restored = len(restored)
            failed = next((a for a in answers if isinstance(a, BaseException)), None)
            if failed is not None:
                raise failed
        except (UpstreamClientError, UpstreamError) as exc:
            # only speed is lost either way; a timeout or a busy server is passing, a
            # refusal (501 without --slot-save-path) is not
            if isinstance(exc, UpstreamError) and exc.status in _PASSING:
                log.info("slot copy failed (%s); those slots prefill in the batch", exc)
            else:
                self.available = False
                log.warning("slot save/restore unavailable (%s); prefilling in the batch", exc)
        return restored

    def _observe_restore(self, answer: dict[str, Any]) -> None:
        """The server's own timing of a restore (`timings.restore_ms` over `n_restored`)."""
        self.restore_ms_per_token = self._rate(
            self.restore_ms_per_token, answer, "n_restored", "restore_ms"
        )

    def _observe_save(self, answer: dict[str, Any]) -> None:
        """The server's own timing of a save (`timings.save_ms` over `n_saved`)."""
        self.save_ms_per_token = self._rate(self.save_ms_per_token, answer, "n_saved", "save_ms")

    def _rate(
        self, rate: float | None, answer: dict[str, Any], count_key: str, ms_key: str
    ) -> float | None:
        """`rate` (ms a token) moved toward what a slot action's answer reports, where it
        moved enough tokens to say."""
        count = answer.get(count_key)
        ms = (answer.get("timings") or {}).get(ms_key)
        if isinstance(count, int) and count >= self.min_prompt and ms is not None:
            return running_mean(rate, float(ms) / count, _RATE_ALPHA)
        return rate

    async def clear_stale(self, prompt: Sequence[int]) -> list[int]:
        """Before a generation's first prefill: empty the idle slots holding copies that
        ended generations left, of contexts that `prompt` does not go on from (less than
        half of one is its prefix); returns the ids erased. With unified KV a prefill's
        512-token micro-batches attend over every cell in use: on the H200 (14B f16) a 4k
        prefill took 1,084 ms with the other 8 slots holding 4k contexts against 304 ms
        alone (`verify-cost` parts g and f; docs/BENCHMARKS.md, "The regime server"). The
        slot holding an ended speculative generation's context goes too: its cells lie
        spread over the pool (`SlotCopies.leave`). A conversation's own copies and
        context stay for its next turn."""
        if not (self.clear_stale_copies and self.available) or len(prompt) < self.min_prompt:
            return []
        stale = {
            id_slot for id_slot, context in self.left_copies.items()
            if common_prefix_length(context, prompt) < len(context) // 2
        }  # fmt: skip
        if not stale:
            return []
        return await self.erase_idle(stale)

    async def keep_latest(self) -> list[int]:
        """After a pass-through with no other stream running: empty every idle slot that
        holds a context but the one the server used last (the highest task id); returns
        the ids erased. llama-server picks the least recently used slot for a prompt
        that no slot holds, so without this every new conversation would leave the
        last one's context in place, and with unified KV every decode attends over all
        of them: two 4k contexts where llama-server alone (`-np 1`) attends over one cost
        the H200 (14B f16) 0.1 ms a step per thousand cells, 4% (docs/BENCHMARKS.md,
        "Plain decoding behind the proxy"). Only speed depends on it."""
        if not (self.clear_stale_copies and self.available):
            return []
        try:
            listing = await self.upstream.slots()
        except (UpstreamClientError, UpstreamError) as exc:
            log.info("reading the slots failed (%s); plain decoding may run slower", exc)
            return []
        held = [
            s for s in listing if not s.get("is_processing") and s.get("n_prompt_tokens", 0) > 0
        ]
        if len(held) < 2:
            return []
        latest = max(held, key=lambda s: s.get("id_task", -1))
        return await self.erase_idle({s["id"] for s in held if s is not latest}, listing)

    async def erase_idle(
        self, slots: set[int], listing: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Empty the caches of those of `slots` that are idle now (a busy one may serve
        another request already) and that no generation in flight uses; returns the ids
        erased. `listing`: /slots as the caller just read it. Only speed depends on it: a
        failure is logged and ends the erasing."""
        erased: list[int] = []
        try:
            listing = listing if listing is not None else await self.upstream.slots()
            idle = {s["id"] for s in listing if not s.get("is_processing")}
            for id_slot in sorted((slots & idle) - set(self.in_flight)):
                await self.upstream.slot_action(id_slot, "erase", "")
                erased.append(id_slot)
                self.left_copies.pop(id_slot, None)  # nothing left there to clear
                self.left_holds.pop(id_slot, None)
        except (UpstreamClientError, UpstreamError) as exc:
            log.info("emptying idle slots failed (%s); plain decoding may run slower", exc)
        return erased


# what `SlotCopies.warm_for` did before a batch: nothing; copies into slots the
# generation had not used (they may lag and catch up in the batch); or a fresh copy into
# a slot it had used (the batch's verify time is then a steady round's)
Warmed = Literal["", "copied", "refreshed"]


@dataclass(frozen=True)
class FirstRound:
    """How a generation's first round fills the slots."""

    replicate: bool = False  # prefill one slot, then copy it into the others
    # prefill one slot and copy none: plain runs are the cheaper side (or are measured
    # first), and copying a long context costs more (a slot holds the whole context's
    # KV; docs/BENCHMARKS.md, "Measurements behind design choices") than a later probe
    # of speculation pays to catch up the few slots it uses
    one_slot: bool = False

    @property
    def drafts(self) -> bool:
        """Whether the round drafts (a round that prefills one slot verifies nothing)."""
        return not (self.replicate or self.one_slot)


class SlotCopies:
    """When one generation copies the slot that holds its context into the others."""

    def __init__(
        self,
        replicator: SlotReplicator | None,
        slot_file: str,
        n_prompt: int,
        slots_to_copy: Callable[[], int],
        prompt: Sequence[int] = (),
    ) -> None:
        self.replicator = replicator
        self.slot_file = slot_file
        self.n_prompt = n_prompt
        self.prompt = prompt  # its tokens, to tell what earlier turns left in the slots
        self.slots_to_copy = slots_to_copy  # the draft-length policy's measured need
        # every slot this generation copied its context into or had a batch or run use,
        # and the one that holds the most of its committed context
        self.touched: set[int] = set()
        self.fullest = -1
        # the context prefix that the slots it has not touched are taken to hold (what
        # its first round found cached; nothing after a cold start)
        self.others_hold = 0
        # context tokens in the slot file as this generation last saved it (None: not
        # saved yet; the file may hold another generation's context)
        self.saved_at: int | None = None
        # committed-context tokens each slot it touched holds, where known (a slot not
        # in it is taken to be current)
        self.holds: dict[int, int] = {}
        # erasing the slots `stale` named, in the background: a copy into one of them
        # waits for it
        self.erasing: asyncio.Task[None] | None = None
        # slots no copy may go to: the one the rounds' pad prompt uses (`reserve`)
        self.reserved: set[int] = set()
        # the wall times of copies not yet shown in a round's log line
        self.copy_times: list[CopyTimes] = []

    def first_round(self, one_slot: bool) -> FirstRound:
        """The plan of a first round that has a drafter: one slot is prefilled (and
        copied where copying is on and the prompt long enough) unless all k+1 prefill
        in its verify batch. `one_slot`: plain runs come next (chosen, or measured before
        anything could justify copies)."""
        if one_slot:
            return FirstRound(one_slot=True)
        replicator = self.replicator
        replicate = (
            replicator is not None
            and replicator.available
            and self.n_prompt >= replicator.min_prompt
        )
        return FirstRound(replicate=replicate)

    def observe_first_round(self, server_ms: float, n_fresh: int) -> None:
        """A first round prefilled `n_fresh` tokens in one slot in `server_ms`."""
        if self.replicator is not None:
            self.replicator.observe_prefill(server_ms, n_fresh)

    async def after_first_round(self, id_slot: int, n_cached: int) -> None:
        """Copy the slot the first round prefilled. A new turn of a conversation whose
        slots already hold its history has little to copy: the other slots catch up in
        the next batch."""
        self.others_hold = n_cached
        await self._copy(
            id_slot, self.slots_to_copy(), self.n_prompt - n_cached, n_context=self.n_prompt
        )

    async def catch_up(self, lag: int, n_context: int) -> None:
        """Before speculating after plain runs (or after a first round that prefilled
        one slot): copies of the slot that holds the context, where copying is on and
        the others lag by enough tokens to be worth it."""
        self.others_hold = n_context - lag
        await self._copy(self.fullest, self.slots_to_copy(), lag, n_context=n_context)

    async def warm_for(self, n_prompts: int, n_context: int) -> Warmed:
        """Before a verify batch of `n_prompts` prompts over `n_context` tokens: where
        fewer slots than that hold this generation's context, and the others lag by
        enough to be worth a copy, copy the fullest slot into as many of them. This is a
        round longer than the slots copied so far were meant for (exploring a length, a
        round whose drafts were ready); without the copies its prompts in the other
        slots would prefill what those lag by, the whole context on a cold start (0.6 s
        a slot at 4k on the H200; docs/BENCHMARKS.md, "Fifth run of the day"). Where
        enough slots were touched but one the batch will use lags far behind (`refresh`),
        that one gets a fresh copy, and so do the slots `stale` emptied that the batch
        needs. Says what it did: "copied", "refreshed" or "" (nothing)."""
        refilled = await self._refill(n_prompts, n_context)
        missing = n_prompts - len(self.touched)
        if missing <= 0:
            return "refreshed" if await self.refresh(n_prompts, n_context) or refilled else ""
        copied = await self._copy(
            self.fullest, missing, self._untouched_lag(n_context), keep=self.touched,
            n_context=n_context,
        )  # fmt: skip
        return "copied" if copied else ""

    async def _refill(self, n_prompts: int, n_context: int) -> bool:
        """Before a batch of `n_prompts` prompts: where fewer of the slots this
        generation touched hold its context than that, the ones `stale` emptied get a
        fresh copy of the fullest first (one emptied slot left empty would prefill the
        whole context inside the batch). True when it copied."""
        emptied = sorted(s for s in self.touched if self.holds.get(s) == 0)
        need = min(len(emptied), n_prompts - (len(self.touched) - len(emptied)))
        replicator = self.replicator
        if need <= 0 or replicator is None or not replicator.available or self.fullest < 0:
            return False
        await self._erased()
        copied = await self._replicate(replicator, self.fullest, need, into=emptied[:need])
        if copied:
            log.info("slots %s were emptied: copied the context afresh", copied)
            self.saved_at = n_context
            self.holds.update(dict.fromkeys(copied, n_context))
        return bool(copied)

    def _untouched_lag(self, n_context: int) -> int:
        """How far the idle slots this generation has not touched lag behind: taken as
        what its first round found cached, unless an earlier turn of the conversation
        left the one of them that holds the most of the prompt further behind (a slot
        copied at that turn's cold start and unused since: ~430 tokens on the Strix Halo
        14B chats, caught up at prefill speed inside the batch, 1.5 s) and the measured
        rates say a copy costs less than that catch-up."""
        lag = n_context - self.others_hold
        replicator = self.replicator
        if replicator is None or not self.prompt:
            return lag
        held = [
            min(replicator.left_holds.get(id_slot, len(context)),
                common_prefix_length(context, self.prompt))
            for id_slot, context in replicator.left_copies.items()
            if id_slot not in self.touched and id_slot not in replicator.in_flight
        ]  # fmt: skip
        if not held or max(held) >= self.others_hold:
            return lag
        behind = n_context - max(held)
        if not replicator.refresh_pays(behind, n_context):
            return lag
        log.info("an earlier turn left the idle slots %d tokens behind: copying", behind)
        return behind

    async def refresh(self, n_prompts: int, n_context: int) -> bool:
        """Before a batch of `n_prompts` prompts: the server gives them the slots that
        hold the most of the context, so the least current of the `n_prompts` most
        current slots this generation touched is the one that catches up inside the
        batch. A slot unused since a longer round lags by every token committed since:
        on the Strix Halo 14B (emulated) the draft-length policy's one k = 2 round among
        k = 1 rounds made its third slot prefill 70-360 tokens, 0.3-1.5 s
        (docs/BENCHMARKS.md, "Drafts ready after a miss"). Where the measured rates say
        a fresh copy costs less (`SlotReplicator.refresh_pays`), copy the fullest slot
        into it first: it then holds the whole context and the batch ingests only the
        drafts. True when it copied."""
        replicator = self.replicator
        if (
            replicator is None
            or not replicator.available
            or not 2 <= n_prompts <= len(self.touched)
        ):
            return False
        ranked = sorted(self.touched, key=lambda s: self.holds.get(s, n_context), reverse=True)
        stalest = ranked[n_prompts - 1]
        lag = n_context - self.holds.get(stalest, n_context)
        if stalest == self.fullest or not replicator.refresh_pays(lag, n_context):
            return False
        await self._erased()
        copied = await self._replicate(replicator, self.fullest, 1, into=[stalest])
        if copied:
            log.info("slot %d lagged by %d tokens: copied the context afresh", stalest, lag)
            self.saved_at = n_context
            self.holds[stalest] = n_context
        return bool(copied)

    async def _copy(
        self, id_slot: int, copies: int, lag: int, n_context: int, keep: Collection[int] = ()
    ) -> list[int]:
        """Copy `id_slot` (holding about `n_context` tokens) into up to `copies` other
        slots (none of `keep`) where copying is on, the slots to fill lag by enough
        tokens to be worth it and, at the measured rates, the copy costs less than the
        prefill it spares them (`SlotReplicator.copy_pays`); they count as touched.
        Where this generation saved the slot file before and the measured rates say so,
        the file is restored as it is and the slots prefill what it lacks in the next
        batch: a second save of a long context costs more than that
        (`SlotReplicator.reuse_pays`)."""
        replicator = self.replicator
        if (
            replicator is None or not replicator.available or id_slot < 0
            or not replicator.worth_copying(lag)
        ):  # fmt: skip
            return []
        await self._erased()
        keep = set(keep) | self.reserved
        reuse = self.saved_at is not None and replicator.reuse_pays(
            n_context - self.saved_at, copies, n_context
        )
        held = self.saved_at if reuse and self.saved_at is not None else n_context
        # what the copies spare the slots: the lag, less what a reused file lacks
        spared = lag - (n_context - held)
        if spared <= 0 or not replicator.copy_pays(spared, copies, held, restore_only=reuse):
            return []
        copied = await self._replicate(replicator, id_slot, copies, keep=keep, save=not reuse)
        if copied and not reuse:
            self.saved_at = n_context
        self._touch(copied)
        self.holds.update(dict.fromkeys(copied, held))
        return copied

    async def _replicate(
        self, replicator: SlotReplicator, id_slot: int, copies: int, **options: Any
    ) -> list[int]:
        """`replicator.replicate` into this generation's slot file, its times kept for
        the round that waited for it (`take_copy_times`)."""
        times = CopyTimes()
        copied = await replicator.replicate(id_slot, copies, self.slot_file, times=times, **options)
        if times.restored:
            self.copy_times.append(times)
        return copied

    def take_copy_times(self) -> list[CopyTimes]:
        """The copies made since the last call (the round log shows them)."""
        taken, self.copy_times = self.copy_times, []
        return taken

    def used(
        self, slots: Iterable[int], fullest: int, holds: Mapping[int, int] | None = None
    ) -> None:
        """A verify batch or plain run used `slots`; `fullest` now holds the most of the
        committed context; `holds`: how many committed-context tokens each now holds."""
        self._touch(slots)
        self.fullest = fullest
        self.holds.update(holds or {})

    def stale(self, in_use: Collection[int], n_context: int) -> list[int]:
        """Slots this generation touched that no longer hold anything worth keeping:
        not used by the batch that just ran (`in_use`), behind the `n_context`-token
        context by enough that the measured rates would copy the context afresh into
        them before a longer round uses one (`SlotReplicator.refresh_pays`), and used
        by no other generation. They are marked as holding nothing (a longer round then
        refreshes them, as it would have anyway). With unified KV every decode attends
        over every cell in use: on the Strix Halo 14B chats (emulated) a third slot
        left behind by each k = 2 try held 513-1,252 cells, ~0.4-1.0 ms of every ~55 ms
        round (docs/BENCHMARKS.md, "Slots left behind emptied"). Where a copy costs
        more than a catch-up (the H200: a save costs twice a prefill a token) nothing is
        stale."""
        replicator = self.replicator
        if replicator is None or not replicator.available:
            return []
        dropped = []
        for id_slot in sorted(self.touched - set(in_use)):
            held = self.holds.get(id_slot)
            if held is None or held <= 0 or id_slot == self.fullest:
                continue
            if replicator.in_flight.get(id_slot, 0) > 1:
                continue  # another generation uses it too
            if replicator.refresh_pays(n_context - held, n_context):
                self.holds[id_slot] = 0
                dropped.append(id_slot)
        return dropped

    async def _erased(self) -> None:
        """Wait for the erasing `stale` started (a restore must come after it)."""
        erasing, self.erasing = self.erasing, None
        if erasing is not None:
            await asyncio.gather(erasing, return_exceptions=True)

    async def empty(self, slots: Collection[int], after: asyncio.Task[None] | None = None) -> None:
        """Erase `slots` (`stale`'s), after the erasing started before (`after`): only
        speed depends on it, so a failure is logged."""
        if after is not None:
            await asyncio.gather(after, return_exceptions=True)
        if self.replicator is None:
            return
        try:
            for id_slot in slots:
                await self.replicator.upstream.slot_action(id_slot, "erase", "")
        except (UpstreamClientError, UpstreamError) as exc:
            log.info("emptying a slot left behind failed (%s)", exc)

    def reserve(self, id_slot: int) -> None:
        """`id_slot` serves the rounds' pad prompt (`proxy.engine.round_shape`): no copy
        goes there, and where this generation had used it, it holds nothing of its
        context any more (a batch that needs it again gets another slot, or the pad
        prompt loses it to a copy and moves on)."""
        self.reserved = {id_slot}  # one pad slot: the one it used last
        if id_slot in self.touched:
            self.touched.discard(id_slot)
            self.holds.pop(id_slot, None)
            if self.replicator is not None:
                self.replicator.in_flight[id_slot] -= 1
                if self.replicator.in_flight[id_slot] <= 0:
                    del self.replicator.in_flight[id_slot]

    def _touch(self, slots: Iterable[int]) -> None:
        """This generation uses `slots` from now on: no other clears them meanwhile."""
        fresh = set(slots) - self.touched
        if self.replicator is not None:
            for id_slot in fresh:
                self.replicator.in_flight[id_slot] += 1
                self.replicator.left_copies.pop(id_slot, None)
                self.replicator.left_holds.pop(id_slot, None)
        self.touched |= fresh

    def leave(self, context: Sequence[int]) -> None:
        """The generation ended with `context` committed: the slots it touched are free
        for others to clear, as copies of `context`. The fullest holds `context` itself
        (whatever an earlier generation left there); it counts as one too where the
        generation touched other slots, since its cells then lie spread over the pool
        (`release`); in one slot alone it is what llama-server alone would keep."""
        replicator = self.replicator
        if replicator is None:
            return
        for id_slot in self.touched:
            replicator.in_flight[id_slot] -= 1
            if replicator.in_flight[id_slot] <= 0:
                del replicator.in_flight[id_slot]
            if id_slot == self.fullest and len(self.touched) < 2:
                replicator.left_copies.pop(id_slot, None)
                replicator.left_holds.pop(id_slot, None)
            else:
                replicator.left_copies[id_slot] = context
                replicator.left_holds[id_slot] = self.holds.get(id_slot, len(context))

    async def release(self) -> list[int]:
        """Empty every slot this generation touched, the one holding its context too,
        where it touched more than one (a generation that only ran plain in one slot
        holds its context in that slot's contiguous cells, and keeps it). Called when
        the gate has chosen plain decoding: the next requests pass through.
        With unified KV every decode attends over the pool up to its highest cell in use,
        and a speculative generation's cells lie spread over the pool (each slot appends
        to its own sequence every round), so a context kept in place makes every later
        token slower for any conversation: 4% on the H200 at 512 (14B f16, 0.1 ms a step
        per thousand cells of span; the span stayed at 4.6k cells where llama-server
        alone attends over 0.8k), far more at 4k. A conversation that goes on prefills
        its context once more (37 ms at 512 there) and then holds it in one slot's
        contiguous cells, as llama-server alone would (docs/BENCHMARKS.md, "Plain
        decoding behind the proxy")."""
        if self.replicator is None or not self.replicator.available or len(self.touched) < 2:
            return []
        return await self.replicator.erase_idle(set(self.touched))
