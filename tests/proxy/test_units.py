"""Unit tests with fakes: acceptance, text state, engine loop, scheduler, config, flags."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.api.requests import NotEligible, parse_chat, parse_completion, parse_prompt
from proxy.api.shapes import split_reasoning, thinking_prefix
from proxy.config import ProxySettings, load_settings
from proxy.data.verify import VerifyResult
from proxy.engine import EngineSettings, Generation, GenerationParams
from proxy.engine.acceptance import greedy_accept
from proxy.engine.drafting import DrafterBase
from proxy.engine.server_text import (
    PieceCache,
    ServerTextState,
    find_partial_stop,
    valid_utf8_prefix,
)
from proxy.metrics import ProxyMetrics
from proxy.scheduler import SchedulerBusy, SlotScheduler
from proxy.server.managed import ServerLayout, verification_flags
from proxy.server.upstream import parse_prometheus

# -- acceptance ----------------------------------------------------------------------


def test_greedy_accept_all_then_bonus():
    result = greedy_accept([5, 6, 7], [5, 6, 7, 8])
    assert result.n_accepted == 3 and result.tokens == [5, 6, 7, 8] and result.bonus


def test_greedy_accept_stops_at_first_disagreement():
    result = greedy_accept([5, 9, 7], [5, 6, 7, 8])
    assert result.n_accepted == 1 and result.tokens == [5, 6] and not result.bonus


def test_greedy_accept_no_draft_is_plain_decoding():
    assert greedy_accept([], [42]).tokens == [42]


def test_greedy_accept_checks_lengths():
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


# -- text state (the server's process_token) ------------------------------------------


def test_utf8_prefix_cuts_only_an_incomplete_tail():
    euro = "€".encode()  # 3 bytes
    assert valid_utf8_prefix(b"ab" + euro) == 5
    assert valid_utf8_prefix(b"ab" + euro[:2]) == 2
    assert valid_utf8_prefix(b"ab" + euro[:1]) == 2
    assert valid_utf8_prefix("😀".encode()[:3]) == 0


def test_partial_stop_finds_longest_prefix_at_the_end():
    assert find_partial_stop(b"hello wo", b"world") == 6
    assert find_partial_stop(b"hello", b"world") == -1
    assert find_partial_stop(b"xx", b"") == -1


def _push_all(state, pieces, eog_last=False):
    events = []
    for i, piece in enumerate(pieces):
        events.append(state.push(i, piece, eog_last and i == len(pieces) - 1))
        if state.finished:
            break
    return events


def test_stop_string_across_tokens_is_held_back_then_cut():
    state = ServerTextState(["STOP"], n_prompt=3, n_ctx=100, n_predict=-1)
    events = _push_all(state, [b"ab", b"cS", b"TO", b"Pzz", b"never"])
    # the server holds back ALL unsent text while its tail may start a stop string
    assert [e.text for e in events] == [b"ab", b"", b"", b"c"]
    assert events[-1].stopped_by_word
    assert bytes(state.generated) == b"abc"
    assert state.stop_type == "word" and state.stopping_word == "STOP"
    assert len(state.tokens) == 4


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    state = ServerTextState(["STOP"], n_prompt=3, n_ctx=100, n_predict=-1)
    events = _push_all(state, [b"aS", b"Tx"])
    assert [e.text for e in events] == [b"", b"aSTx"]


def test_incomplete_utf8_token_sends_nothing():
    euro = "€".encode()
    state = ServerTextState([], n_prompt=1, n_ctx=100, n_predict=-1)
    events = _push_all(state, [euro[:1], euro[1:]])
    assert [(e.sent, e.text) for e in events] == [(False, b""), (True, euro)]


def test_n_predict_and_context_limits():
    state = ServerTextState([], n_prompt=5, n_ctx=100, n_predict=2)
    _push_all(state, [b"a", b"b", b"c"])
    assert state.stop_type == "limit" and len(state.tokens) == 2 and not state.truncated
    state = ServerTextState([], n_prompt=5, n_ctx=8, n_predict=-1)
    _push_all(state, [b"a", b"b", b"c", b"d"])
    assert state.truncated and state.stop_type == "limit" and len(state.tokens) == 3


def test_eos_wins_and_adds_no_text():
    state = ServerTextState([], n_prompt=5, n_ctx=100, n_predict=2)
    _push_all(state, [b"a", b""], eog_last=True)
    assert state.stop_type == "eos"


# -- engine loop with a fake server ---------------------------------------------------


class FakeUpstream:
    """A 'server' whose greedy continuation of anything is a fixed script."""

    def __init__(self, script: list[int], eog: set[int] = frozenset()):
        self.script = script
        self.eog = eog
        self.calls: list[tuple[int, list[int]]] = []
        self.decodes = 0

    def _next(self, sequence: list[int], n_prompt: int) -> int:
        return self.script[len(sequence) - n_prompt]

    async def verify(self, context, draft, pad=()):
        self.calls.append((len(context), list(draft)))
        self.decodes += 1
        n_prompt = 2
        prompts = [list(context) + list(draft[:i]) for i in range(len(draft) + 1)]
        results = []
        for prompt in prompts:
            token = self._next(prompt, n_prompt)
            results.append(VerifyResult(token, f"<{token}>", token in self.eog, 0, id_slot=0))
        if pad:
            results.append(VerifyResult(0, "", False, 0, id_slot=-1, prompt_n=len(pad)))
        return results

    async def metrics(self):
        return {"llamacpp:n_decode_total": self.decodes, "llamacpp:prompt_tokens_total": 0}

    async def token_bytes(self, token):  # pragma: no cover - pieces here are plain ASCII
        raise AssertionError


class ScriptDrafter(DrafterBase):
    def __init__(self, script: list[int], n_prompt: int, wrong_at: set[int] = frozenset()):
        self.script, self.n_prompt, self.wrong_at = script, n_prompt, wrong_at
        self.closed = False

    async def propose(self, committed, k):
        start = len(committed) - self.n_prompt
        out = []
        for i in range(start, min(start + k, len(self.script))):
            out.append(-1 if i in self.wrong_at else self.script[i])
        return out

    async def close(self):
        self.closed = True


async def _run(upstream, drafter, n_predict=-1, k=4, n_ctx=1000, stop=()):
    generation = Generation(
        upstream,
        [1, 2],
        GenerationParams(n_predict=n_predict, stop=list(stop)),
        n_ctx=n_ctx,
        drafter=drafter,
        pieces=PieceCache(upstream),
        # fixed k: these tests check a round's mechanics, not the draft-length policy
        settings=EngineSettings(k=k, adaptive=False, check_decodes=True, strict_decodes=True),
    )
    tokens = [event.token async for event in generation.run()]
    return tokens, generation.result


async def test_engine_stops_at_eos_inside_an_accepted_run():
    script = [10, 11, 12, 99, 13, 14, 15, 16, 17]
    upstream = FakeUpstream(script, eog={99})
    drafter = ScriptDrafter(script, 2)
    tokens, result = await _run(upstream, drafter, k=8)
    assert tokens == [10, 11, 12, 99]
    assert result.stop_type == "eos" and drafter.closed
    assert result.content == b"<10><11><12><99>"  # the piece as the server reported it


async def test_a_generation_that_fails_before_its_first_round_closes_its_drafter():
    class MetricsDown(FakeUpstream):
        async def metrics(self):
            raise ConnectionError("llama-server's /metrics is gone")

    script = [10, 11, 12]
    drafter = ScriptDrafter(script, 2)
    with pytest.raises(ConnectionError):
        await _run(MetricsDown(script), drafter)
    assert drafter.closed  # its session, and with it the drafter's KV slot, goes back


class CopyingUpstream(FakeUpstream):
    """A FakeUpstream with three idle slots that records each slot action, with how
    many tokens the consumer had taken by then (`taken`)."""

    def __init__(self, script: list[int], taken: list[int]):
        super().__init__(script)
        self.taken = taken
        self.actions: list[tuple[str, int]] = []

    async def slots(self):
        return [{"id": i, "is_processing": False} for i in range(3)]

    async def slot_action(self, id_slot, action, filename):
        self.actions.append((action, self.taken[0]))
        return {}


@pytest.mark.parametrize("send_ahead", [True, False])
async def test_a_cold_requests_first_token_is_streamed_before_its_slot_copies(send_ahead):
    """The first round prefills one slot; copying it into the others comes after its
    token is out, so the copies are not in the time to first token."""
    from proxy.engine import SlotReplicator

    script = list(range(100, 140))
    taken = [0]
    upstream = CopyingUpstream(script, taken)
    generation = Generation(
        upstream, [1, 2], GenerationParams(n_predict=20), n_ctx=1000,
        drafter=ScriptDrafter(script, 2), pieces=PieceCache(upstream),
        settings=EngineSettings(k=2, adaptive=False, send_ahead=send_ahead),
        replicator=SlotReplicator(upstream, min_prompt=2),
    )  # fmt: skip
    tokens = []
    async for event in generation.run():
        tokens.append(event.token)
        taken[0] += 1
    assert tokens == script[:20]
    assert upstream.actions[:2] == [("save", 1), ("restore", 1)]


async def test_engine_never_drafts_past_n_predict():
    script = list(range(100, 130))
    upstream = FakeUpstream(script)
    tokens, result = await _run(upstream, ScriptDrafter(script, 2), n_predict=7, k=4)
    assert tokens == script[:7]
    assert [len(draft) for _, draft in upstream.calls] == [4, 1]  # 5 + 2 tokens
    assert result.stop_type == "limit"


async def test_engine_keeps_prompts_inside_the_context():
    script = list(range(100, 130))
    upstream = FakeUpstream(script)
    tokens, result = await _run(upstream, ScriptDrafter(script, 2), k=8, n_ctx=9)
    # the server alone stops when prompt + generated reaches n_ctx
    assert tokens == script[:7] and result.truncated
    assert all(n + len(d) < 9 for n, d in upstream.calls)


async def test_engine_rejection_and_stats():
    script = list(range(100, 130))
    upstream = FakeUpstream(script)
    tokens, result = await _run(upstream, ScriptDrafter(script, 2, wrong_at={2}), n_predict=10)
    assert tokens == script[:10]
    assert result.rounds[0].n_accepted == 2 and result.rounds[0].n_committed == 3
    assert result.draft_n_accepted < result.draft_n
    assert all(r.decodes == 1 for r in result.rounds)


class BrokenDrafter(DrafterBase):
    closed = False

    async def propose(self, committed, k):
        raise RuntimeError("boom")

    async def close(self):
        BrokenDrafter.closed = True


async def test_engine_falls_back_to_plain_decoding_when_the_drafter_fails():
    script = list(range(100, 110))
    upstream = FakeUpstream(script)
    metrics = ProxyMetrics()
    generation = Generation(
        upstream, [1, 2], GenerationParams(n_predict=5), 1000, BrokenDrafter(),
        PieceCache(upstream), observer=metrics, settings=EngineSettings(k=4),
    )  # fmt: skip
    tokens = [event.token async for event in generation.run()]
    assert tokens == script[:5]
    assert generation.result.drafter_failed and metrics.drafter_failures == 1
    assert BrokenDrafter.closed
    assert [len(d) for _, d in upstream.calls] == [0] * 5


# -- request eligibility -----------------------------------------------------------

DEFAULTS = {"temperature": 0.8, "top_k": 40, "n_predict": -1, "repeat_penalty": 1.0}


def test_greedy_native_request_is_eligible():
    prompt, params = parse_completion(
        {"prompt": "hi", "n_predict": 5, "temperature": 0, "stop": "x"}, DEFAULTS, oai=False
    )
    assert prompt == "hi" and params.n_predict == 5 and params.stop == ["x"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "typical_p": 0.9},  # sampling with a stage the engine does not mirror
        {"prompt": "hi", "temperature": 0, "grammar": "root ::= [a-z]"},
        {"prompt": "hi", "temperature": 0, "n_probs": 2},
        {"prompt": "hi", "temperature": 0, "repeat_penalty": 1.1},
        {"prompt": "hi", "temperature": 0, "n_predict": "x"},
        {"prompt": ["a", "b"], "temperature": 0},
        {"prompt": "hi", "temperature": 0, "n_predict": 3, "max_tokens": 4},
        {"prompt": "hi", "temperature": 0, "unknown_field": 1},
    ],
)
def test_requests_outside_the_engine_are_not_eligible(body):
    with pytest.raises(NotEligible):
        parse_completion(body, DEFAULTS, oai=False)


def test_prompt_forms():
    assert parse_prompt([1, 2, 3]) == [1, 2, 3]
    assert parse_prompt([[1, 2]]) == [1, 2]
    assert parse_prompt(["a", 5]) == ["a", 5]
    assert parse_prompt(["only"]) == "only"
    for several_or_bad in ([True, 2], ["a", "b"], [], [["a"]], {"prompt_string": "x"}):
        with pytest.raises(NotEligible):
            parse_prompt(several_or_bad)


def test_chat_with_tools_or_images_passes_through():
    base = {"temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(base, DEFAULTS).n_predict == -1
    assert parse_chat({**base, "tools": []}, DEFAULTS).n_predict == -1  # no tools at all
    tool = {"type": "function", "function": {"name": "f"}}
    assert parse_chat({**base, "tools": [tool]}, DEFAULTS).offers_tools  # until a tool call
    for extra in (
        {"tools": [tool], "tool_choice": "required"},
        {"tools": [{"type": "code_interpreter"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"n": 2},
        {"logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"}]},
    ):
        with pytest.raises(NotEligible):
            parse_chat({**base, **extra}, DEFAULTS)


# -- chat parsing ------------------------------------------------------------------


def test_reasoning_split_like_the_servers_parser():
    msg = split_reasoning("<think>\nplan\n</think>\n\nanswer ")
    assert (msg.reasoning_content, msg.content) == ("\nplan\n", "answer ")
    assert split_reasoning("  plain").content == "plain"
    prefix = thinking_prefix("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msg = split_reasoning(" text", prefix)
    assert (msg.reasoning_content, msg.content) == ("", "text")
    assert thinking_prefix("<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n") == ""


# -- scheduler ---------------------------------------------------------------------


async def test_scheduler_queues_in_order_and_frees_on_cancel():
    scheduler = SlotScheduler(total_slots=7, group_size=3)  # two groups
    assert scheduler.n_groups == 2
    assert await scheduler.acquire() == 0
    assert await scheduler.acquire() == 1
    waiter = asyncio.create_task(scheduler.acquire())
    cancelled = asyncio.create_task(scheduler.acquire())
    await asyncio.sleep(0)
    assert scheduler.queued == 2
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert scheduler.queued == 1
    scheduler.release(1)
    assert await asyncio.wait_for(waiter, 1) == 1  # handed over, never free in between
    assert scheduler.active == 2
    scheduler.release(0)
    scheduler.release(1)
    assert scheduler.active == 0


async def test_scheduler_passthrough_policy_and_timeout():
    scheduler = SlotScheduler(3, 3, when_busy="passthrough")
    async with scheduler.lease():
        with pytest.raises(SchedulerBusy):
            await scheduler.acquire()
    queued = SlotScheduler(3, 3, queue_timeout_s=0.05)
    assert await queued.acquire() == 0
    with pytest.raises(SchedulerBusy):
        await queued.acquire()
    assert queued.queued == 0
    with pytest.raises(SchedulerBusy):
        await SlotScheduler(2, 3).acquire()  # fewer slots than one group


# -- config, flags, metrics ------------------------------------------------------------


def test_settings_precedence_cli_over_env_over_file(tmp_path: Path, monkeypatch):
    config = tmp_path / "npu-spec.toml"
    config.write_text('upstream = "http://file:1"\nk = 3\nport = 9000\nllama-server = "/x"\n')
    monkeypatch.setenv("NPU_SPEC_K", "5")
    settings = load_settings({"port": 9100}, config)
    assert settings.upstream == "http://file:1"
    assert settings.k == 5 and settings.port == 9100 and settings.llama_server == Path("/x")


def test_settings_need_exactly_one_target():
    with pytest.raises(ValueError):
        ProxySettings()
    with pytest.raises(ValueError):
        ProxySettings(target="m.gguf", upstream="http://x")


def test_managed_flags():
    layout = ServerLayout(k=4, ctx_per_conversation=1000, conversations=2, passthrough_slots=1)
    flags = verification_flags(layout, Path("/slots"))
    joined = " ".join(flags)
    assert "-np 11" in joined and "-c 11264" in joined and "--kv-unified-per-slot 1024" in joined
    for flag in ("-kvu", "--no-cache-idle-slots", "--metrics"):
        assert flag in flags
    assert "-cram 0" in joined and "--slot-save-path /slots" in joined
    assert "id_slot" not in joined


def test_metrics_render_and_parse():
    from proxy.engine import RoundRecord

    metrics = ProxyMetrics()
    metrics.observe_round(RoundRecord(4, 2, 3, 5.0, 20.0, 1.0, decodes=1))
    metrics.observe_round(RoundRecord(0, 0, 1, 0.0, 20.0, 1.0, decodes=1))  # nothing drafted
    metrics.observe_round(RoundRecord(1, 1, 2, 0.0, 20.0, 1.0, decodes=1, runner_up_line=True))
    metrics.observe_round(RoundRecord(0, 0, 3, 0.0, 20.0, 1.0, plain_run=True))  # no round
    metrics.observe_generation(30, 1.5)
    values = parse_prometheus(metrics.render())
    assert values["npu_spec_rounds_total"] == 3
    assert values["npu_spec_empty_draft_rounds_total"] == 1
    assert values["npu_spec_runner_up_line_rounds_total"] == 1
    assert values["npu_spec_draft_tokens_total"] == 5
    assert values["npu_spec_accepted_tokens_total"] == 3
    assert values["npu_spec_verify_ms_count"] == 3
    page = metrics.render()
    assert 'npu_spec_accepted_tokens_per_position_total{position="1"} 1' in page
    assert 'npu_spec_accepted_tokens_per_position_total{position="2"} 0' in page


async def test_replication_failure_only_costs_speed():
    from proxy.engine import SlotReplicator
    from proxy.server.upstream import UpstreamError

    script = list(range(100, 120))

    class NoSlotSave(FakeUpstream):
        async def slots(self):
            return [{"id": i, "is_processing": False} for i in range(4)]

        async def slot_action(self, id_slot, action, filename):
            raise UpstreamError("http://x", "POST /slots/0?action=save: not supported", 502)

    upstream = NoSlotSave(script)
    replicator = SlotReplicator(upstream, min_prompt=1)
    generation = Generation(
        upstream, [1, 2], GenerationParams(n_predict=8), 1000,
        ScriptDrafter(script, 2), PieceCache(upstream), replicator=replicator,
        settings=EngineSettings(k=3, adaptive=False),
    )  # fmt: skip
    tokens = [event.token async for event in generation.run()]
    assert tokens == script[:8] and not replicator.available
    assert [len(d) for _, d in upstream.calls] == [0, 3, 2]  # plain first round, then drafts


@pytest.mark.parametrize(
    "data, kept",
    [
        (b"", 0),
        (b"ab\xe2\x82\xac", 5),  # complete euro sign
        (b"ab\xe2\x82", 2),  # cut inside it
        (b"ab\xc3", 2),
        (b"\xe2A", 0),  # a lead byte two back whose sequence an ASCII byte broke
        (b"\xf0\xc3\xa9", 0),  # a complete 2-byte character inside a cut 4-byte one
        (b"\xe2\xc3\xa9", 3),  # a 3-byte lead three back fits
        (b"ab\xf8", 3),  # 0xF8-0xFF never lead
        (b"abcde\xc3", 5),
        (b"\x80\x80\x80\x80", 4),
    ],
)
def test_server_utf8_prefix_follows_llama_servers_validate_utf8(data: bytes, kept: int) -> None:
    from proxy.engine.server_text import server_utf8_prefix

    assert server_utf8_prefix(data) == kept


def test_text_behind_a_broken_sequence_is_held_back_as_the_server_does() -> None:
    state = ServerTextState(stop_words=[], n_prompt=1, n_ctx=100, n_predict=-1)
    assert state.push(1, b"\xe2", False).sent is False
    assert state.push(2, b"A", False).sent is False  # the server still sees a cut lead byte
    event = state.push(3, b"BC", False)
    assert event.sent and event.text == b"\xe2ABC"


class SlotServer:
    """/slots and slot actions of a 7-slot server whose slot 5 is busy; `fail_on`:
    the action (id, name) that fails, and with which error."""

    def __init__(self, fail_on: tuple[tuple[int, str], Exception] | None = None) -> None:
        self.actions: list[tuple[int, str]] = []
        self.fail_on = fail_on
        self.n_saved = 300  # tokens a save reports
        self.save_ms_per_token = 0.15  # what it reports a save took (the H200's rate)
        self.restore_ms_per_token: float | None = None  # None: restores report no timing

    async def slots(self):
        return [{"id": i, "is_processing": i == 5} for i in range(7)]

    async def slot_action(self, id_slot, action, filename):
        if self.fail_on is not None and self.fail_on[0] == (id_slot, action):
            raise self.fail_on[1]
        self.actions.append((id_slot, action))
        if action == "save":  # llama-server's answer, timings included
            return {
                "id_slot": id_slot,
                "n_saved": self.n_saved,
                "timings": {"save_ms": self.save_ms_per_token * self.n_saved},
            }
        if action == "restore" and self.restore_ms_per_token is not None:
            return {
                "id_slot": id_slot,
                "n_restored": self.n_saved,
                "timings": {"restore_ms": self.restore_ms_per_token * self.n_saved},
            }
        return {}


def slot_copies(server: SlotServer, n_prompt: int = 300):
    from proxy.engine import SlotReplicator
    from proxy.engine.slot_copies import SlotCopies

    return SlotCopies(SlotReplicator(server, min_prompt=64), "f.bin", n_prompt, lambda: 1)


async def test_slot_warm_up_copies_the_fullest_slot_into_slots_not_holding_the_context():
    server = SlotServer()
    copies = slot_copies(server)
    assert not await copies.warm_for(4, 300)  # no slot holds the context yet
    copies.used([0, 2], fullest=2)
    assert not await copies.warm_for(2, 300)  # enough slots
    assert not await copies.warm_for(4, 40)  # short: prefilling in the batch is as cheap
    assert await copies.warm_for(4, 300)
    # saved from the fullest, restored into idle slots that do not hold it (not 0)
    assert server.actions == [(2, "save"), (1, "restore"), (3, "restore")]
    assert copies.touched == {0, 1, 2, 3}
    assert not await copies.warm_for(4, 300)


async def test_slot_warm_up_leaves_slots_that_hold_most_of_the_context_to_catch_up():
    """A new turn whose history the server's slots hold: the others lag by the new
    tokens only, which they take in within the batch, as the first round judged."""
    server = SlotServer()
    copies = slot_copies(server)
    await copies.after_first_round(0, n_cached=280)  # 20 new tokens: no copy
    copies.used([0], fullest=0)
    assert not await copies.warm_for(4, 310)
    assert await copies.warm_for(4, 280 + 64)  # now they lag by a copy's worth
    assert server.actions[0] == (0, "save")


async def test_slot_warm_up_saves_nothing_without_a_free_slot():
    server = SlotServer()
    copies = slot_copies(server)
    copies.used([0, 1, 2, 3, 4, 6], fullest=0)  # and 5 is busy
    assert not await copies.warm_for(7, 300)
    assert server.actions == []


async def test_a_passing_copy_failure_keeps_copies_on_and_counts_the_slots_restored():
    from proxy.server.upstream import UpstreamError

    timeout = UpstreamError("http://x", "POST /slots/3?action=restore timed out", 504)
    server = SlotServer(fail_on=((3, "restore"), timeout))
    copies = slot_copies(server)
    copies.used([0, 2], fullest=2)
    assert await copies.warm_for(4, 300)
    assert copies.touched == {0, 1, 2} and copies.replicator.available
    refusal = UpstreamError("http://x", "POST /slots/2?action=save: not supported", 502)
    server.fail_on = ((2, "save"), refusal)
    assert not await copies.warm_for(5, 300)
    assert not copies.replicator.available


class SlowRestores(SlotServer):
    """Each restore takes 20 ms; counts how many were in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most_in_flight = 0

    async def slot_action(self, id_slot, action, filename):
        if action != "restore":
            return await super().slot_action(id_slot, action, filename)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        return await super().slot_action(id_slot, action, filename)


async def test_a_copy_sends_its_restores_at_once_after_the_save_and_keeps_their_times():
    server = SlowRestores()
    copies = slot_copies(server)
    copies.used([0], fullest=0)
    assert await copies.warm_for(4, 300) == "copied"
    assert server.actions[0] == (0, "save") and server.most_in_flight == 3
    assert sorted(server.actions[1:]) == [(1, "restore"), (2, "restore"), (3, "restore")]
    [times] = copies.take_copy_times()
    assert times.restored == 3 and 20 <= times.restore_ms < 55 and times.save_ms >= 0
    assert copies.take_copy_times() == []  # taken once


async def test_copies_only_where_they_cost_less_than_the_prefill_they_spare():
    """The H200's rates (server timings: a save 0.095 ms a token, a restore 0.029, a
    one-slot prefill 0.072). A cold 512-token start copies into three slots (93 ms
    against 111 ms of prefill); a later turn whose slots lack 299 of 934 tokens lets
    them prefill those (65 ms) rather than copy (170 ms), and so does a cold start that
    needs one slot only (64 ms against 37)."""
    from proxy.engine import SlotReplicator
    from proxy.engine.slot_copies import SlotCopies

    server = SlotServer()
    server.save_ms_per_token, server.restore_ms_per_token = 0.095, 0.029
    replicator = SlotReplicator(server, min_prompt=64)

    async def first_round(n_prompt: int, n_cached: int, slots: int) -> list:
        copies = SlotCopies(replicator, "f.bin", n_prompt, lambda: slots)
        copies.observe_first_round(
            server_ms=0.072 * (n_prompt - n_cached), n_fresh=n_prompt - n_cached
        )
        before = len(server.actions)
        await copies.after_first_round(0, n_cached=n_cached)
        return server.actions[before:]

    # rates not yet measured: the first cold start copies, and measures them
    assert len(
        await first_round(512, 0, 3)
    ) == 4 and replicator.restore_ms_per_token == pytest.approx(0.029)
    assert [a for _, a in await first_round(512, 0, 3)] == ["save"] + ["restore"] * 3
    assert await first_round(934, 635, 3) == []
    assert await first_round(512, 0, 1) == []
    replicator.copy_by_cost = False  # `--copy-by-cost off`: wherever 64 tokens are missing
    assert len(await first_round(934, 635, 3)) == 4


def copies_after_a_cold_fill(server: SlotServer, prefill_ms_per_token: float):
    """A 500-token prompt prefilled in slot 0 at the given rate; saves cost 0.15 ms a
    token (the caller copies it)."""
    server.n_saved, server.save_ms_per_token = 500, 0.15
    copies = slot_copies(server, n_prompt=500)
    copies.observe_first_round(server_ms=prefill_ms_per_token * 500, n_fresh=500)
    copies.used([0], fullest=0, holds={0: 500})
    return copies


async def test_a_slot_left_behind_gets_a_fresh_copy_where_its_catch_up_costs_more():
    """Strix Halo 14B rates (the regime file: a save 0.15 ms a token, a prefill past
    the 8-token edge ~4): slot 2, last used 100 tokens ago, would prefill those inside
    the next 3-prompt batch (~400 ms) where a fresh copy of the 600-token context costs
    ~90 ms. The batch's other slots are current; a 2-prompt batch leaves slot 2 alone."""
    server = SlotServer()
    copies = copies_after_a_cold_fill(server, prefill_ms_per_token=4.0)
    await copies.after_first_round(0, n_cached=0)  # into slot 1
    copies.used([0, 1], fullest=1, holds={0: 520, 1: 519})
    assert await copies.warm_for(3, 520) == "copied"  # slot 2 first used: a plain copy
    copies.used([0, 1, 2], fullest=2, holds={0: 520, 1: 520, 2: 520})
    copies.used([0, 1], fullest=0, holds={0: 599, 1: 598})
    before = len(server.actions)
    assert await copies.warm_for(2, 600) == ""
    assert await copies.warm_for(3, 600) == "refreshed"
    assert server.actions[before:] == [(0, "save"), (2, "restore")]
    assert copies.holds[2] == 600 and copies.saved_at == 600
    assert await copies.warm_for(3, 601) == ""  # current now


@pytest.mark.parametrize(("prefill_ms_per_token", "emptied"), [(4.0, [2]), (0.074, [])])
async def test_a_slot_left_behind_for_good_is_emptied_where_a_fresh_copy_would_replace_it(
    prefill_ms_per_token, emptied
):
    """A k = 2 try filled slot 2; the rounds since used 0 and 1. At the Strix Halo rates
    a longer round would copy the context afresh into slot 2 once it lags by 80 tokens,
    so what it holds only widens every decode's span: it is emptied, and the next longer
    round refreshes it. At the H200's rates it would catch up in the batch: it stays."""
    server = SlotServer()
    copies = copies_after_a_cold_fill(server, prefill_ms_per_token)
    await copies.after_first_round(0, n_cached=0)
    copies.used([0, 1, 2], fullest=2, holds={0: 520, 1: 520, 2: 520})
    copies.used([0, 1], fullest=0, holds={0: 560, 1: 559})
    assert copies.stale({0, 1}, 560) == []  # 40 behind: a catch-up costs less
    copies.used([0, 1], fullest=0, holds={0: 600, 1: 599})
    copies.replicator.in_flight[2] += 1  # another generation uses slot 2 too
    assert copies.stale({0, 1}, 600) == []
    copies.replicator.in_flight[2] -= 1
    assert copies.stale({0, 1}, 600) == emptied
    assert copies.stale({0, 1}, 600) == []  # once
    before = len(server.actions)
    await copies.empty(emptied)
    assert server.actions[before:] == [(2, "erase")] * len(emptied)
    if emptied:
        assert copies.holds[2] == 0
        assert await copies.warm_for(3, 600) == "refreshed"
        assert server.actions[-2:] == [(0, "save"), (2, "restore")]


async def test_emptied_slots_a_longer_batch_needs_are_filled_before_it():
    """Two k = 3 rounds touched slots 0-3; k = 1 rounds since left 2 and 3 behind, and
    both were emptied. A 4-prompt batch gets both filled afresh first (one left empty
    would prefill the whole context inside the batch); a 3-prompt batch, one."""
    server = SlotServer()
    copies = copies_after_a_cold_fill(server, prefill_ms_per_token=4.0)
    await copies.after_first_round(0, n_cached=0)
    copies.used([0, 1, 2, 3], fullest=3, holds=dict.fromkeys(range(4), 520))
    copies.used([0, 1], fullest=0, holds={0: 600, 1: 599})
    assert copies.stale({0, 1}, 600) == [2, 3]
    await copies.empty([2, 3])
    before = len(server.actions)
    assert await copies.warm_for(3, 600) == "refreshed"
    assert server.actions[before:] == [(0, "save"), (2, "restore")]
    assert copies.holds[2] == 600 and copies.holds[3] == 0
    copies.used([0, 1], fullest=0, holds={0: 700, 1: 699})
    copies.holds[2] = 0  # emptied again
    before = len(server.actions)
    assert await copies.warm_for(4, 700) == "refreshed"
    assert server.actions[before:] == [(0, "save"), (2, "restore"), (3, "restore")]


@pytest.mark.parametrize(
    ("prefill_ms_per_token", "lag"),
    [(0.074, 100), (4.0, 40)],  # the H200's prefill: a save costs more; a short lag
)
async def test_a_slot_left_behind_catches_up_in_the_batch_where_that_costs_less(
    prefill_ms_per_token, lag
):
    server = SlotServer()
    copies = copies_after_a_cold_fill(server, prefill_ms_per_token)
    await copies.after_first_round(0, n_cached=0)
    copies.used([0, 1, 2], fullest=2, holds={0: 500, 1: 500, 2: 500})
    copies.used([0, 1], fullest=0, holds={0: 500 + lag, 1: 500 + lag})
    before = len(server.actions)
    assert await copies.warm_for(3, 500 + lag) == ""
    assert server.actions[before:] == []


@pytest.mark.parametrize(("prefill_ms_per_token", "copied"), [(4.0, "copied"), (0.074, "")])
async def test_a_new_turn_copies_into_a_slot_an_earlier_turn_left_behind(
    prefill_ms_per_token, copied
):
    """A chat's first turn filled slots 0-2 at its cold start (500 tokens) and then used
    only 0 and 1 up to 900. The next turn (920 prompt tokens, 900 cached) runs in 0 and 1;
    its first 3-prompt round would send slot 2 to catch up on 430 tokens inside the
    batch. At the Strix Halo rates a copy costs less, so slot 0 is copied first; at the
    H200's the catch-up is cheaper and nothing changes."""
    server = SlotServer()
    first = copies_after_a_cold_fill(server, prefill_ms_per_token)
    await first.after_first_round(0, n_cached=0)  # a save: its rate measured
    first.used([0, 1, 2], fullest=0, holds={0: 500, 1: 500, 2: 500})
    first.used([0, 1], fullest=0, holds={0: 900, 1: 899})
    context = list(range(900))
    first.leave(context)
    assert first.replicator.left_holds == {0: 900, 1: 899, 2: 500}
    from proxy.engine.slot_copies import SlotCopies

    turn = SlotCopies(first.replicator, "f.bin", 920, lambda: 1, [*context, *range(20)])
    server.n_saved = 920
    await turn.after_first_round(0, n_cached=900)  # 20 new tokens: no copy
    turn.used([0, 1], fullest=0, holds={0: 925, 1: 925})
    before = len(server.actions)
    assert await turn.warm_for(3, 930) == copied
    expected = [(0, "save"), (2, "restore")] if copied else []
    assert server.actions[before:] == expected
    # a prompt that does not go on from what was left: the first turn's rule
    other = SlotCopies(first.replicator, "f.bin", 920, lambda: 1, list(range(5000, 5920)))
    await other.after_first_round(3, n_cached=900)
    other.used([3, 4], fullest=3, holds={3: 925, 4: 925})
    assert other._untouched_lag(930) == 30


async def test_a_later_copy_restores_the_generations_own_file_where_a_new_save_costs_more():
    """H200 rates (save 0.150 ms a token, prefill 0.074 a token and slot): at 4k a
    second save costs 0.6 s, while two slots prefilling the 100 tokens the first
    file lacks cost ~15 ms; so the file is restored as it is. A gap as long as the
    context is worth a new save."""
    server = SlotServer()
    server.n_saved = 4096
    copies = slot_copies(server, n_prompt=4096)
    copies.observe_first_round(server_ms=0.074 * 4096, n_fresh=4096)
    await copies.after_first_round(0, n_cached=0)
    assert server.actions == [(0, "save"), (1, "restore")] and copies.saved_at == 4096
    copies.used([0, 1], fullest=1)
    assert await copies.warm_for(4, 4096 + 100)
    assert server.actions[2:] == [(2, "restore"), (3, "restore")]  # no second save
    assert copies.saved_at == 4096


async def test_where_a_save_is_cheap_every_copy_saves_the_context_anew():
    """A CPU's rates (a save of 3,000 tokens in 5 ms, a prefill 0.1 ms a token)."""
    server = SlotServer()
    server.n_saved, server.save_ms_per_token = 3000, 5.0 / 3000
    copies = slot_copies(server, n_prompt=3000)
    copies.observe_first_round(server_ms=300.0, n_fresh=3000)
    await copies.after_first_round(0, n_cached=0)
    copies.used([0, 1], fullest=1)
    assert await copies.warm_for(4, 3000 + 100)
    assert server.actions == [
        (0, "save"),
        (1, "restore"),
        (1, "save"),
        (2, "restore"),
        (3, "restore"),
    ]
    assert copies.saved_at == 3100


def test_reusing_a_file_needs_both_rates_measured():
    from proxy.engine import SlotReplicator

    replicator = SlotReplicator(SlotServer(), min_prompt=64)
    assert not replicator.reuse_pays(gap=10, copies=1, n_context=4096)
    replicator.observe_prefill(server_ms=300.0, n_tokens=4096)
    assert not replicator.reuse_pays(gap=10, copies=1, n_context=4096)  # no save timed
    replicator._observe_save({"n_saved": 3000, "timings": {"save_ms": 5.0}})  # a CPU's
    assert not replicator.reuse_pays(gap=100, copies=3, n_context=3000)
    assert replicator.reuse_pays(gap=0, copies=3, n_context=3000)


def test_slot_file_reuse_off_always_saves_anew():
    from proxy.engine import SlotReplicator

    replicator = SlotReplicator(SlotServer(), min_prompt=64, reuse_files=False)
    replicator.observe_prefill(server_ms=300.0, n_tokens=4096)
    replicator._observe_save({"n_saved": 4096, "timings": {"save_ms": 600.0}})  # the H200's
    assert not replicator.reuse_pays(gap=0, copies=3, n_context=4096)


async def test_copies_an_ended_generation_left_are_emptied_before_another_conversation():
    """With unified KV a prefill attends over every cell in use (a 4k prefill on the
    H200: 1,084 ms with the other slots full, 304 ms alone), so the copies of a
    conversation that ended are emptied before a different conversation's first prefill,
    its fullest slot too (a speculative generation's cells lie spread over the pool);
    copies of a context the new prompt goes on from stay."""
    server = SlotServer()
    ended = slot_copies(server)
    ended.used([0, 1, 2], fullest=2)
    context = list(range(1, 301))
    ended.leave(context)
    replicator = ended.replicator
    live = slot_copies(server)  # another generation still uses slots 4 and 6
    live.replicator = replicator
    live.used([4, 6], fullest=6)
    assert await replicator.clear_stale([*context, 7, 8, 9]) == []  # the next turn
    assert await replicator.clear_stale(list(range(1000, 1300))) == [0, 1, 2]
    assert server.actions == [(0, "erase"), (1, "erase"), (2, "erase")]
    assert replicator.left_copies == {}
    # a copy left while slot 4 is still used by the other generation is not cleared
    again = slot_copies(server)
    again.replicator = replicator
    again.used([3, 4], fullest=3)
    again.leave(context)
    assert await replicator.clear_stale(list(range(1000, 1300))) == [3]  # not 4
    live.leave(list(range(500, 800)))  # no generation uses slot 4 now: a copy again
    assert await replicator.clear_stale(list(range(1000, 1300))) == [4, 6]


async def test_stale_copies_stay_with_clearing_off_or_a_short_prompt():
    server = SlotServer()
    ended = slot_copies(server)
    ended.used([0, 1], fullest=1)
    ended.leave(list(range(1, 301)))
    assert await ended.replicator.clear_stale([5] * 10) == []  # short: no gain
    ended.replicator.clear_stale_copies = False
    assert await ended.replicator.clear_stale(list(range(1000, 1300))) == []
    assert server.actions == []


async def test_a_slot_that_became_another_generations_fullest_is_not_cleared_as_a_copy():
    server = SlotServer()
    first, second = slot_copies(server), slot_copies(server)
    second.replicator = first.replicator
    first.used([0, 4], fullest=0)
    second.used([4], fullest=4)  # both use slot 4 at once
    first.leave(list(range(1, 301)))  # slot 4 left as a copy of the first's context ...
    second.leave(list(range(500, 800)))  # ... but it holds the second's whole context now
    # (in its one slot's cells); the first's spread context in slot 0 goes
    assert await first.replicator.clear_stale(list(range(1000, 1300))) == [0]


async def test_the_round_after_the_first_counts_as_catching_up():
    """On a new turn the other slots ingest the turn's new tokens inside the second
    round's batch (too few to copy): that round is no steady speculation speed, for the
    plain-run gate nor for the draft lengths."""
    script = list(range(100, 130))
    upstream = FakeUpstream(script)
    tokens, result = await _run(upstream, ScriptDrafter(script, 2), n_predict=12, k=2)
    assert tokens == script[:12]
    first, second, *steady = result.rounds
    assert first.first and second.catch_up and steady
    assert not any(r.catch_up for r in steady)


async def test_release_empties_a_spread_context_but_keeps_a_one_slot_one():
    """Once plain decoding is chosen: a generation that used several slots has its
    context's cells spread over the pool (unified KV attends up to the highest), so
    every slot it touched is emptied; one that ran in one slot keeps its context."""
    server = SlotServer()
    spread = slot_copies(server)
    spread.used([0, 1, 2], fullest=2)
    spread.leave(list(range(1, 301)))
    assert sorted(await spread.release()) == [0, 1, 2]
    single = slot_copies(server)
    single.used([3], fullest=3)
    single.leave(list(range(1, 301)))
    assert await single.release() == []
    assert server.actions == [(0, "erase"), (1, "erase"), (2, "erase")]


class HeldSlotServer(SlotServer):
    """Slots 0-4 and 6 hold contexts left by tasks 10-15 (slot 4's is the latest);
    slot 5 is busy."""

    async def slots(self):
        return [
            {"id": i, "is_processing": i == 5, "n_prompt_tokens": 0 if i == 3 else 100,
             "id_task": 10 + i if i != 4 else 99}
            for i in range(7)
        ]  # fmt: skip


async def test_keep_latest_empties_idle_contexts_but_the_latest_and_those_in_use():
    from proxy.engine import SlotReplicator

    server = HeldSlotServer()
    replicator = SlotReplicator(server, min_prompt=64)
    replicator.in_flight[1] += 1  # a generation still uses slot 1
    assert sorted(await replicator.keep_latest()) == [0, 2, 6]  # not 1, 3 (empty), 4, 5
    replicator.clear_stale_copies = False
    assert await replicator.keep_latest() == []


def test_the_decode_check_lets_first_and_catch_up_rounds_prefill_in_several_decodes():
    """A catch-up round may prefill hundreds of tokens per slot where copies cost more
    (past the server's -b: several decodes); a steady round must take one."""
    from proxy.engine.decode_check import DecodeCounter, DecodeCountError

    counter = DecodeCounter(upstream=None, check=True, strict=True, request_id="r")  # type: ignore[arg-type]
    counter.check(3, 0)
    counter.check(2, 1, catch_up=True)
    counter.check(1, 2)
    with pytest.raises(DecodeCountError, match="round 3 took 2 server decodes"):
        counter.check(2, 3)
