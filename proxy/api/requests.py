"""Which requests the speculative path can serve losslessly, and their parameters.

Anything not explicitly understood here goes through to llama-server untouched, so
the server itself answers (and validates) it: a whitelist, never a blacklist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from npu_draft.protocol import SamplingParams
from proxy.upstream import MAX_VERIFY_TOP_K, SAMPLING_CHAIN, SamplingSpec


class NotEligible(Exception):
    """The request must be passed through; the message says why (for logs)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Sampling knobs whose effective value must be a no-op for argmax decoding.
# The effective value is the request's, else the server's default from /props.
_NOOP_SAMPLING: dict[str, Any] = {
    "repeat_penalty": lambda v: _is_number(v) and v == 1.0,
    "presence_penalty": lambda v: _is_number(v) and v == 0.0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0.0,
    "dry_multiplier": lambda v: _is_number(v) and v == 0.0,
    "mirostat": lambda v: _is_int(v) and v == 0,
    "typical_p": lambda v: _is_number(v) and v >= 1.0,  # locally typical can drop the argmax
    "xtc_probability": lambda v: _is_number(v) and v <= 0.0,  # XTC removes top tokens
    "n_probs": lambda v: _is_int(v) and v == 0,
    "ignore_eos": lambda v: v is False,
}

# Knobs that cannot change the argmax (they only ever keep the most likely token).
_HARMLESS_NUMBERS = {
    "top_k", "top_p", "min_p", "top_n_sigma", "seed", "dynatemp_range", "dynatemp_exponent",
    "repeat_last_n", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat_tau",
    "mirostat_eta", "min_keep", "n_keep", "xtc_threshold",
}  # fmt: skip
_HARMLESS_BOOLS = {"cache_prompt", "return_tokens", "post_sampling_probs"}

_COMMON_KEYS = (
    set(_NOOP_SAMPLING)
    | _HARMLESS_NUMBERS
    | _HARMLESS_BOOLS
    | {"stream", "stop", "temperature", "model", "stream_options"}
    | {"n_predict", "max_tokens", "max_completion_tokens"}
)
NATIVE_KEYS = _COMMON_KEYS | {"prompt"}
OAI_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "n", "user", "logprobs"}
CHAT_KEYS = _COMMON_KEYS | {"messages", "n", "user", "chat_template_kwargs", "logprobs"}


@dataclass
class SpecParams:
    n_predict: int  # -1: unlimited (the server's own default applied)
    stop: list[str]
    stream: bool
    include_usage: bool = False
    request_fields: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingSpec | None = None  # None: greedy


# llama.cpp's default chain; the server's own (from /props) may reorder or drop stages.
DEFAULT_SAMPLERS = [
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
]  # fmt: skip
# Stages that are no-ops at their neutral values (checked in _NOOP_SAMPLING or below).
_NEUTRAL_STAGES = {"penalties", "dry", "top_n_sigma", "typ_p", "xtc"}
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # the server's "-1": a random seed


def _sampling_spec(
    body: dict[str, Any], defaults: dict[str, Any], temperature: float
) -> SamplingSpec:
    """The exact sampling chain of a temperature > 0 request, or NotEligible.

    The verify batch applies top_k -> top_p -> min_p -> temperature and nothing else,
    so the request's effective chain must be exactly that (other stages neutral),
    and top_k must bound the distribution so n_probs can return all of it.
    """
    samplers = defaults.get("samplers") or DEFAULT_SAMPLERS
    if not isinstance(samplers, list) or not all(isinstance(x, str) for x in samplers):
        raise NotEligible("unknown server sampler chain")
    unknown = [x for x in samplers if x not in SAMPLING_CHAIN and x not in _NEUTRAL_STAGES]
    if unknown:
        raise NotEligible(f"sampler stages the speculative path does not mirror: {unknown}")
    mirrored = [x for x in samplers if x in SAMPLING_CHAIN]
    if mirrored != [x for x in SAMPLING_CHAIN if x in mirrored]:
        raise NotEligible(f"sampler order {mirrored} differs from {SAMPLING_CHAIN}")
    for stage in ("top_k", "temperature"):
        if stage not in mirrored:
            raise NotEligible(f"the server's chain has no {stage}")
    for key in ("top_n_sigma", "dynatemp_range"):  # both neutral at <= 0
        value = _effective(body, defaults, key)
        if value is not None and not (_is_number(value) and value <= 0.0):
            raise NotEligible(f"{key}={value!r} is not mirrored")
    top_k = _effective(body, defaults, "top_k")
    if not _is_int(top_k) or not 1 <= top_k <= MAX_VERIFY_TOP_K:
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
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p) if top_p is not None and "top_p" in mirrored else 1.0,
        min_p=float(min_p) if min_p is not None and "min_p" in mirrored else 0.0,
    )
    return SamplingSpec(
        chain=chain,
        min_keep=int(min_keep or 0),
        seed=None if seed == LLAMA_DEFAULT_SEED else seed,
    )


def _effective(body: dict[str, Any], defaults: dict[str, Any], key: str) -> Any:
    return body[key] if key in body else defaults.get(key)


def _check_common(body: dict[str, Any], defaults: dict[str, Any], allowed: set[str]) -> SpecParams:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise NotEligible(f"fields the speculative path does not handle: {unknown}")
    for key in _HARMLESS_NUMBERS:
        if key in body and body[key] is not None and not _is_number(body[key]):
            raise NotEligible(f"{key} is not a number")
    for key in _HARMLESS_BOOLS | {"stream"}:
        if key in body and not isinstance(body[key], bool):
            raise NotEligible(f"{key} is not a boolean")
    for key, is_noop in _NOOP_SAMPLING.items():
        value = _effective(body, defaults, key)
        if value is not None and not is_noop(value):
            raise NotEligible(f"{key}={value!r} changes greedy output")
    if body.get("n", 1) != 1:
        raise NotEligible("n > 1")
    if body.get("logprobs") not in (None, False):
        raise NotEligible("logprobs requested")
    temperature = _effective(body, defaults, "temperature")
    top_k = _effective(body, defaults, "top_k")
    if not _is_number(temperature):
        raise NotEligible("temperature is not a number")
    greedy = temperature <= 0.0 or (_is_int(top_k) and top_k == 1)
    sampling = None if greedy else _sampling_spec(body, defaults, temperature)

    limits = [k for k in ("n_predict", "max_tokens", "max_completion_tokens") if k in body]
    if len(limits) > 1:
        raise NotEligible(f"several token limits given: {limits}")
    n_predict = body[limits[0]] if limits else defaults.get("n_predict", -1)
    if not _is_int(n_predict) or n_predict < -1:
        raise NotEligible("invalid n_predict")
    if n_predict == 0:
        raise NotEligible("n_predict = 0 only evaluates the prompt")

    stop_value = body.get("stop")
    if stop_value is None:
        stop: list[str] = []
    elif isinstance(stop_value, str):
        stop = [stop_value]
    elif isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        stop = [s for s in stop_value if s]
    else:
        raise NotEligible("stop is not a string or a list of strings")

    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise NotEligible("stream_options is not an object")
        include_usage = bool(stream_options.get("include_usage", False))
    if "model" in body and not isinstance(body["model"], str):
        raise NotEligible("model is not a string")
    return SpecParams(
        n_predict=n_predict,
        stop=stop,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        request_fields=body,
        sampling=sampling,
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
    return params
