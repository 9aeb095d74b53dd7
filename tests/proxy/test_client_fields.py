"""Which fields real clients send take the speculative path (decisions only, no
server: test_clients_server.py checks the same bodies against llama-server)."""

from __future__ import annotations

import pytest

from proxy.api.requests import NotEligible, parse_chat, parse_completion
from proxy.api.sampler_chain import parse_samplers
from tests.proxy.client_bodies import greedy_client_bodies, web_ui
from tests.proxy.test_sampling_units import DEFAULTS

MESSAGES = [{"role": "user", "content": "hi"}]


def decide(body: dict, defaults: dict = DEFAULTS) -> str:
    """greedy | sampling | the pass-through reason."""
    try:
        params = parse_chat({"messages": MESSAGES, **body}, defaults)
    except NotEligible as exc:
        return f"pass: {exc}"
    return "greedy" if params.sampling is None else "sampling"


@pytest.mark.parametrize("name", sorted(greedy_client_bodies("m", MESSAGES)))
def test_every_client_body_is_greedy_speculative(name):
    assert decide(greedy_client_bodies("m", MESSAGES)[name]) == "greedy"


def test_web_ui_at_the_servers_default_temperature_samples_speculatively():
    assert decide(web_ui(MESSAGES)) == "sampling"
    spec = parse_chat(web_ui(MESSAGES), DEFAULTS).sampling
    assert spec is not None
    assert (spec.chain.top_k, spec.chain.top_p, spec.chain.min_p) == (40, 0.95, 0.05)


def test_sampler_names_aliases_and_letters_read_as_the_server_reads_them():
    assert parse_samplers("kfypmt") == ["top_k", "typ_p", "top_p", "min_p", "temperature"]
    assert parse_samplers("edskypmxt") == [
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
        "temperature",
    ]  # fmt: skip
    assert parse_samplers(["Top-K", "nucleus", "minp", "temp", "typ", "bogus"]) == [
        "top_k", "top_p", "min_p", "temperature", "typ_p",
    ]  # fmt: skip
    assert parse_samplers([]) == []


# (fields, decision at temperature 0, decision at 0.8); decisions name the kind only
FIELD_TABLE = [
    ({}, "greedy", "sampling"),
    ({"repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0}, "greedy", "sampling"),
    ({"repeat_penalty": 1.1}, "pass", "pass"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 0}, "greedy", "sampling"),  # penalties off
    ({"presence_penalty": 0.5}, "pass", "pass"),
    ({"dry_multiplier": 0.0, "dry_base": 3}, "greedy", "sampling"),
    ({"dry_multiplier": 0.8}, "pass", "pass"),
    ({"xtc_probability": 0.0, "xtc_threshold": 0.1}, "greedy", "sampling"),
    ({"xtc_probability": 0.5, "xtc_threshold": 0.6}, "greedy", "sampling"),  # > 0.5: off
    ({"xtc_probability": 0.5}, "pass", "pass"),
    ({"typical_p": 1.0}, "greedy", "sampling"),
    ({"typical_p": 0.5}, "pass", "pass"),
    ({"typ_p": 0.5}, "greedy", "sampling"),  # not a server field
    ({"dynatemp_range": 0.0, "dynatemp_exponent": 2}, "greedy", "sampling"),
    ({"dynatemp_range": 0.5}, "pass", "pass"),  # entropy-driven even from temperature 0
    ({"top_n_sigma": 1.5}, "greedy", "pass"),  # keeps the argmax; not mirrored sampling
    ({"top_k": 1}, "greedy", "greedy"),
    ({"top_k": 0}, "greedy", "pass"),  # unbounded top_k cannot be sent back in full
    ({"min_p": 0.3, "top_p": 0.5}, "greedy", "sampling"),
    ({"logit_bias": {}}, "greedy", "sampling"),
    ({"logit_bias": []}, "greedy", "sampling"),
    ({"logit_bias": {"15": -100}}, "pass", "pass"),
    ({"n": 1}, "greedy", "sampling"),
    ({"n": 2}, "pass", "pass"),
    ({"response_format": {"type": "text"}}, "greedy", "sampling"),
    ({"response_format": {"type": "json_object"}}, "pass", "pass"),
    ({"tools": [], "parallel_tool_calls": False, "tool_choice": "none"}, "greedy", "sampling"),
    ({"reasoning_format": "none"}, "greedy", "sampling"),
    ({"reasoning_format": "deepseek-legacy"}, "pass", "pass"),
    ({"timings_per_token": True, "return_progress": True}, "greedy", "sampling"),
    ({"stream_options": {"include_usage": True}, "cache_prompt": False}, "greedy", "sampling"),
    ({"id_slot": 2, "user": "u", "model": "m", "sse_ping_interval": 1}, "greedy", "sampling"),
    ({"reasoning_control": True, "backend_sampling": False}, "greedy", "sampling"),
    ({"backend_sampling": True}, "pass", "pass"),
    ({"mirostat": 2}, "pass", "pass"),
    ({"ignore_eos": True}, "pass", "pass"),
    ({"n_probs": 3}, "pass", "pass"),
    ({"grammar": "root ::= [a-z]+"}, "pass", "pass"),
    # sampler orders
    ({"samplers": ["top_k"], "top_k": 1}, "greedy", "greedy"),
    ({"samplers": "kfypmt"}, "greedy", "sampling"),
    ({"samplers": "edskypmxt", "repeat_penalty": 1.2}, "pass", "pass"),
    ({"samplers": "kt", "repeat_penalty": 1.2, "typical_p": 0.2}, "greedy", "sampling"),
    ({"samplers": ["top_p"]}, "pass", "pass"),  # no temperature stage: draws at 1
    ({"samplers": []}, "pass", "pass"),
    ({"samplers": "tk"}, "greedy", "pass"),  # temperature before top_k: not mirrored
    ({"samplers": ["top_k", "infill", "temperature"]}, "pass", "pass"),
    ({"samplers": ["top_k", "adaptive_p", "temperature"]}, "pass", "pass"),
    ({"samplers": 7}, "pass", "pass"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "at_zero", "at_default"), FIELD_TABLE, ids=str)
def test_field_table(fields, at_zero, at_default):
    assert decide({**fields, "temperature": 0}).split(":")[0] == at_zero
    assert decide({**fields, "temperature": 0.8}).split(":")[0] == at_default


def test_native_completion_with_a_top_k_chain_at_temperature_0_is_greedy():
    body = {"prompt": "hi", "samplers": ["top_k"], "top_k": 1, "temperature": 0}
    assert parse_completion(body, DEFAULTS, oai=False)[1].sampling is None


def test_servers_own_chain_is_read_from_props():
    no_temperature_stage = {**DEFAULTS, "samplers": ["top_k", "top_p"]}
    assert decide({"temperature": 0}, no_temperature_stage).startswith("pass")
    assert decide({"temperature": 0, "top_k": 1}, no_temperature_stage) == "greedy"


def test_reasoning_format_defaults_to_the_servers_split():
    # /props reports "none" for a default task whatever the server runs with
    props = {**DEFAULTS, "reasoning_format": "none"}
    body = {"messages": MESSAGES, "temperature": 0}
    assert parse_chat(body, props).reasoning_format == "auto"
    assert parse_chat({**body, "reasoning_format": "none"}, props).reasoning_format == "none"


def test_running_timings_and_progress_have_the_servers_keys():
    from proxy.api.formats import ChatCompletion, NativeCompletion
    from proxy.api.shapes import ResponseContext, prompt_progress, running_timings

    timings = running_timings(n_prompt=10, n_decoded=3, prompt_ms=20.0, predicted_ms=8.0)
    assert list(timings) == [
        "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
        "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
    ]  # fmt: skip
    assert timings["predicted_per_token_ms"] == 4.0 and timings["prompt_per_second"] == 500.0
    ctx = ResponseContext("m", "b1", 10, "p", {})
    progress = prompt_progress(10, 10, 20.4)
    assert progress == {"total": 10, "cache": 0, "processed": 10, "time_ms": 20}
    chat = ChatCompletion(ctx).progress_chunk(progress)
    assert chat["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert NativeCompletion(ctx).progress_chunk(progress)["tokens"] == [0]


def test_reasoning_format_none_keeps_the_text_as_generated():
    from proxy.api.shapes import parse_chat_output

    text = "<think>plan</think>answer"
    assert parse_chat_output(text, "", "none").content == text
    split = parse_chat_output(text, "", "deepseek")
    assert (split.reasoning_content, split.content) == ("plan", "answer")


def test_fallback_drops_what_was_sent_and_keeps_the_tool_call():
    from proxy.api.tool_calls import fallback_events

    def chunk(delta, finish=None):
        return {"choices": [{"delta": delta, "finish_reason": finish, "index": 0}], "id": "x"}

    server = [
        {**chunk({"role": "assistant", "content": None}), "prompt_progress": {}},
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "get_datetime"}}]}),
        chunk({}, "tool_calls"),
    ]
    out = fallback_events(server, "Let me ch", "", sent_role=True)
    assert [e["choices"][0]["delta"] for e in out] == [
        {"content": "eck."},
        {"tool_calls": [{"index": 0, "function": {"name": "get_datetime"}}]},
        {},
    ]
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # nothing sent yet: the role chunk goes on too
    assert fallback_events(server, "", "", sent_role=False)[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
    }
