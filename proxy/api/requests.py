"""Which requests the speculative path can serve losslessly, and their parameters.

Anything not explicitly understood here goes through to llama-server untouched, so
the server itself answers (and validates) it: a whitelist, never a blacklist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from npu_draft.protocol import SamplingParams
from proxy.api.sampler_chain import (
    DEFAULT_SAMPLERS,
    MIRRORED_ORDER,
    ChainError,
    Effect,
    parse_samplers,
    stage_effect,
)
from proxy.data.sampling import MAX_VERIFY_TOP_K, SamplingSpec


class NotEligible(Exception):
    """The request must be passed through; the message says why (for logs)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Knobs checked whatever the chain: each changes the draw or the output when not at
# this value. The effective value is the request's, else the server's default (/props).
_NOOP_ALWAYS: dict[str, Any] = {
    "mirostat": lambda v: _is_int(v) and v == 0,  # replaces the whole chain
    "n_probs": lambda v: _is_int(v) and v == 0,  # the engine returns no probabilities
    "ignore_eos": lambda v: v is False,  # biases every end-of-generation token
}

# Numbers the server reads into stages whose effect sampler_chain judges (or that do
# not touch the distribution: seed, n_keep); any number is accepted here.
_NUMBERS = {
    "top_k", "top_p", "min_p", "top_n_sigma", "seed", "dynatemp_range", "dynatemp_exponent",
    "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "typical_p",
    "xtc_probability", "xtc_threshold", "mirostat_tau", "mirostat_eta", "min_keep", "n_keep",
    "adaptive_target", "adaptive_decay",
    # presentation: pings while the stream is silent, the slot the client would like
    "sse_ping_interval", "id_slot",
}  # fmt: skip
# Fields real clients send that llama-server does not read at all (its schema skips
# unknown keys): llama.cpp's web UI sends `typ_p` (the server reads `typical_p`),
# LM Studio-style clients send `ttl` (LM Studio's model idle time-out).
IGNORED_BY_SERVER = {"typ_p", "ttl"}
_BOOLS = {
    "cache_prompt", "return_tokens", "post_sampling_probs",
    # presentation and reporting: the proxy shapes the response as the server would
    "timings_per_token", "return_progress",
    # arms the reasoning-budget sampler, unlimited unless a client ends reasoning
    # through the server's control endpoint (which finds no server task for a
    # speculative request: documented in docs/CLIENTS.md)
    "reasoning_control",
}  # fmt: skip
# How the server splits reasoning out of a chat answer; deepseek-legacy (reasoning
# kept in content too, and streamed inside content) is not reproduced.
REASONING_FORMATS = {"none", "auto", "deepseek"}

_COMMON_KEYS = (
    set(_NOOP_ALWAYS)
    | _NUMBERS
    | _BOOLS
    | {"stream", "stop", "temperature", "model", "stream_options", "samplers", "logit_bias"}
    | {"n_predict", "max_tokens", "max_completion_tokens", "backend_sampling", "user"}
    | IGNORED_BY_SERVER
)
NATIVE_KEYS = _COMMON_KEYS | {"prompt"}
OAI_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "n", "logprobs"}
CHAT_KEYS = _COMMON_KEYS | {
    "messages", "n", "chat_template_kwargs", "logprobs", "reasoning_format",
    "response_format", "tools", "tool_choice", "parallel_tool_calls",
    # changes the template's input only: the prompt comes from the server's own
    # /apply-template with the whole body, so it is exact
    "reasoning_effort",
}  # fmt: skip


@dataclass
class SpecParams:
    n_predict: int  # -1: unlimited (the server's own default applied)
    stop: list[str]
    stream: bool
    include_usage: bool = False
    request_fields: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingSpec | None = None  # None: greedy
    timings_per_token: bool = False
    return_progress: bool = False
    reasoning_format: str = "auto"  # chat only: how reasoning_content is split
    offers_tools: bool = False  # chat only: the server arms a lazy tool-call grammar


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # the server's "-1": a random seed


def _effective(body: dict[str, Any], defaults: dict[str, Any], key: str) -> Any:
    return body[key] if key in body else defaults.get(key)


def effective_chain(body: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """The sampler stages the server would run for this request, in order."""
    if "samplers" in body:
        try:
            return parse_samplers(body["samplers"])
        except ChainError as exc:
            raise NotEligible(str(exc)) from None
    samplers = defaults.get("samplers")
    if samplers is None:
        return list(DEFAULT_SAMPLERS)
    if not isinstance(samplers, list) or not all(isinstance(x, str) for x in samplers):
        raise NotEligible("unknown server sampler chain")
    return parse_samplers(samplers)


def chain_decision(body: dict[str, Any], defaults: dict[str, Any]) -> SamplingSpec | None:
    """None for a request the server decodes greedily; the mirrored sampling chain for
    one the verify batch can reproduce; NotEligible for anything else.

    Greedy: some stage leaves only the argmax (temperature <= 0 without dynamic
    temperature, or top_k = 1) and no stage anywhere could drop or demote it.
    Sampling: the stages that are not no-ops are exactly top_k -> top_p -> min_p ->
    temperature in that order (top_p, min_p optional).
    """
    chain = effective_chain(body, defaults)

    def value(key: str) -> Any:
        return _effective(body, defaults, key)

    effects = {stage: stage_effect(stage, value) for stage in chain}
    changing = [s for s in chain if effects[s] is Effect.CHANGES]
    if changing:
        raise NotEligible(f"sampler stages that change the distribution: {changing}")
    if any(e is Effect.ARGMAX for e in effects.values()):
        return None
    temperature = _effective(body, defaults, "temperature")
    if not _is_number(temperature):
        raise NotEligible("temperature is not a number")
    if "temperature" not in chain or "top_k" not in chain:
        raise NotEligible(f"sampling without both top_k and temperature in the chain: {chain}")
    if effects.get("top_n_sigma") is Effect.KEEPS_ARGMAX:
        raise NotEligible("top_n_sigma > 0 is not mirrored when sampling")
    active = [s for s in chain if effects[s] is Effect.MIRRORED]
    if active != [s for s in MIRRORED_ORDER if s in active] or len(active) != len(set(active)):
        raise NotEligible(f"sampler order {active} differs from {MIRRORED_ORDER}")
    return _sampling_spec(body, defaults, float(temperature), set(active))


def _sampling_spec(
    body: dict[str, Any], defaults: dict[str, Any], temperature: float, active: set[str]
) -> SamplingSpec:
    """The exact sampling chain of a temperature > 0 request; top_k must bound the
    distribution so n_probs can return all of it."""
    top_k = _effective(body, defaults, "top_k")
    if "top_k" not in active or not _is_int(top_k) or not 1 <= top_k <= MAX_VERIFY_TOP_K:
        raise NotEligible(f"top_k={top_k!r}: sampling needs 1 <= top_k <= {MAX_VERIFY_TOP_K}")
    top_p = _effective(body, defaults, "top_p")
    min_p = _effective(body, defaults, "min_p")
    min_keep = _effective(body, defaults, "min_keep")
    for key, value in (("top_p", top_p), ("min_p", min_p), ("min_keep", min_keep)):
        if value is not None and not _is_number(value):
            raise NotEligible(f"{key} is not a number")
    if min_keep is not None and not (_is_int(min_keep) and min_keep >= 0):
        raise NotEligible("min_keep is not a non-negative integer")
    seed = _effective(body, defaults, "seed")
    if seed is not None and not _is_int(seed):
        raise NotEligible("seed is not an integer")
    seed = None if seed is None else seed % 2**32  # the server keeps it as uint32
    chain = SamplingParams(
        temperature=temperature,
        top_k=int(top_k),
        top_p=float(top_p) if top_p is not None and "top_p" in active else 1.0,
        min_p=float(min_p) if min_p is not None and "min_p" in active else 0.0,
    )
    return SamplingSpec(
        chain=chain,
        min_keep=int(min_keep or 0),
        seed=None if seed == LLAMA_DEFAULT_SEED else seed,
    )


# Fields the server refuses outside these bounds (server-schema.cpp set_hard_limits);
# such a request goes through so the server answers with its own 400. Fields with
# soft limits are clamped by the server, as sampler_chain reads them.
_HARD_LIMITS = {
    "n_keep": (-1, 2**31 - 1), "repeat_last_n": (0, 2**31 - 1),
    "dry_allowed_length": (0, 2**31 - 1), "dry_penalty_last_n": (0, 2**31 - 1),
    "min_keep": (0, 2**31 - 1), "adaptive_decay": (0.0, 0.99),
    "sse_ping_interval": (-1, 2**31 - 1),
}  # fmt: skip


def _check_common(body: dict[str, Any], defaults: dict[str, Any], allowed: set[str]) -> SpecParams:
    """The checks and parameters every speculative route shares; the first check that
    fails names the reason."""
    _check_fields(body, defaults, allowed)
    sampling = chain_decision(body, defaults)
    n_predict = _token_limit(body, defaults)
    stop = _stop_words(body.get("stop"))
    include_usage = _include_usage(body.get("stream_options"))
    if "model" in body and not isinstance(body["model"], str):
        raise NotEligible("model is not a string")
    return SpecParams(
        n_predict=n_predict,
        stop=stop,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        request_fields=body,
        sampling=sampling,
        timings_per_token=bool(body.get("timings_per_token", False)),
        return_progress=bool(body.get("return_progress", False)),
    )


def _check_fields(body: dict[str, Any], defaults: dict[str, Any], allowed: set[str]) -> None:
    """Only known fields, of the right types, within the server's limits, and none
    that changes the output in a way the speculative path does not reproduce."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise NotEligible(f"fields the speculative path does not handle: {unknown}")
    for key in _NUMBERS:
        if key in body and body[key] is not None and not _is_number(body[key]):
            raise NotEligible(f"{key} is not a number")
    for key, (low, high) in _HARD_LIMITS.items():
        if key in body and body[key] is not None and not low <= body[key] <= high:
            raise NotEligible(f"{key}={body[key]!r}: the server refuses it")
    for key in _BOOLS | {"stream"}:
        if key in body and not isinstance(body[key], bool):
            raise NotEligible(f"{key} is not a boolean")
    for key, is_noop in _NOOP_ALWAYS.items():
        value = _effective(body, defaults, key)
        if value is not None and not is_noop(value):
            raise NotEligible(f"{key}={value!r} changes the output")
    if body.get("backend_sampling") not in (None, False):
        raise NotEligible("backend_sampling runs the chain on the backend: not mirrored")
    if body.get("logit_bias") not in (None, {}, []):
        raise NotEligible("logit_bias is not empty")
    if body.get("n", 1) != 1:
        raise NotEligible("n > 1")
    if body.get("logprobs") not in (None, False):
        raise NotEligible("logprobs requested")
    if "user" in body and not isinstance(body["user"], str | None):
        raise NotEligible("user is not a string")


def _token_limit(body: dict[str, Any], defaults: dict[str, Any]) -> int:
    limits = [k for k in ("n_predict", "max_tokens", "max_completion_tokens") if k in body]
    if len(limits) > 1:
        raise NotEligible(f"several token limits given: {limits}")
    n_predict = body[limits[0]] if limits else defaults.get("n_predict", -1)
    if not _is_int(n_predict) or n_predict < -1:
        raise NotEligible("invalid n_predict")
    if n_predict == 0:
        raise NotEligible("n_predict = 0 only evaluates the prompt")
    return n_predict


def _stop_words(stop_value: Any) -> list[str]:
    if stop_value is None:
        return []
    if isinstance(stop_value, str):
        return [stop_value]
    if isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        return [s for s in stop_value if s]
    raise NotEligible("stop is not a string or a list of strings")


def _include_usage(stream_options: Any) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise NotEligible("stream_options is not an object")
    return bool(stream_options.get("include_usage", False))


def _is_function_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        tool.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    )


PromptSpec = str | list[int] | list[str | int]


def parse_prompt(prompt: Any, top_level: bool = True) -> PromptSpec:
    """One text or token prompt, read as the server's tokenize_input_prompts reads it:
    an array holding any integer is ONE prompt (tokens, or tokens mixed with text);
    an array without integers is a list of prompts, served here only when it has one.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise NotEligible("empty prompt")
        return prompt
    if isinstance(prompt, list):
        if any(_is_int(t) for t in prompt):
            if all(_is_int(t) or isinstance(t, str) for t in prompt):
                return list(prompt)
        elif top_level and len(prompt) == 1:
            return parse_prompt(prompt[0], top_level=False)
    raise NotEligible("prompt is not a single text or token prompt")


def parse_completion(
    body: Any, defaults: dict[str, Any], oai: bool
) -> tuple[PromptSpec, SpecParams]:
    if not isinstance(body, dict):
        raise NotEligible("body is not a JSON object")
    params = _check_common(body, defaults, OAI_COMPLETION_KEYS if oai else NATIVE_KEYS)
    if "prompt" not in body:
        raise NotEligible("no prompt")
    return parse_prompt(body["prompt"]), params


def parse_chat(body: Any, defaults: dict[str, Any]) -> SpecParams:
    if not isinstance(body, dict):
        raise NotEligible("body is not a JSON object")
    params = _check_common(body, defaults, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotEligible("messages missing or empty")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise NotEligible("malformed message")
        if set(message) - {"role", "content", "name", "reasoning_content"}:
            raise NotEligible("message with tool calls or other extra fields")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            # content parts may carry images or audio: multimodal goes through
            raise NotEligible("message content is not plain text")
    if messages[-1].get("role") == "assistant":
        # assistant prefill: the server parses the continuation with the prefilled text
        raise NotEligible("continuing a final assistant message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise NotEligible("chat_template_kwargs is not an object")
    tools = body.get("tools")
    if tools not in (None, []) and not (
        isinstance(tools, list) and all(_is_function_tool(t) for t in tools)
    ):
        raise NotEligible("tools other than named functions")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise NotEligible("tool_choice forces a tool call: the grammar binds from the start")
    params.offers_tools = bool(tools) and body.get("tool_choice", "auto") == "auto"
    if not isinstance(body.get("parallel_tool_calls", False), bool):
        raise NotEligible("parallel_tool_calls is not a boolean")
    if not isinstance(body.get("reasoning_effort", ""), str):
        raise NotEligible("reasoning_effort is not a string")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise NotEligible("response_format other than text")
    # /props reports "none" for a default task whatever --reasoning-format the server
    # runs with; the server's own default (deepseek/auto) splits the same way
    reasoning_format = body.get("reasoning_format", "auto")
    if reasoning_format not in REASONING_FORMATS:
        raise NotEligible(f"reasoning_format {reasoning_format!r} is not reproduced")
    params.reasoning_format = reasoning_format
    return params
