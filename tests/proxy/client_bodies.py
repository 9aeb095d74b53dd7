"""Request bodies real clients send, taken from their sources (pinned where possible).

- llama.cpp's web UI (b11434): tools/ui/src/lib/services/chat.service.ts
  (ChatService.sendMessage) and stores/chat/index.svelte.ts (getApiOptions). Sampling
  settings are sent only once the user changes them from the server's defaults;
  `stream`, `timings_per_token`, `backend_sampling`, `return_progress`,
  `sse_ping_interval`, `reasoning_format`, `reasoning_control` and the UI's built-in
  tools always are.
- Open WebUI: backend/open_webui/utils/payload.py (apply_model_params_to_body_openai
  maps temperature, top_p, min_p, max_tokens, frequency_penalty, presence_penalty,
  reasoning_effort, seed, stop, logit_bias, response_format into the body) and
  routers/openai.py (model, messages, stream; metadata popped before sending).
- LM Studio-style clients: LM Studio's OpenAI-compatible API documentation lists
  model, messages, temperature, top_p, top_k, max_tokens, stream, stop,
  presence_penalty, frequency_penalty, logit_bias, repeat_penalty, seed, and `ttl`
  (LM Studio's own idle time-out, which llama-server does not read).
"""

from __future__ import annotations

from typing import Any

# The web UI's sampler setting, when a user fills it in, is a ";"-separated list.
WEB_UI_SAMPLERS = "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature"


# The tools the web UI offers with every chat unless the user turns them off
# (stores/tools.svelte.ts browserTools: get_datetime, and get_info when the server
# has none); their definitions as the UI sends them.
WEB_UI_TOOLS = [
    {"type": "function", "function": {
        "name": "get_datetime",
        "description": "Returns the current local date and time in ISO 8601 format, "
        "with the IANA time zone name",
        "parameters": {"properties": {}, "required": [], "type": "object"}}},
    {"type": "function", "function": {
        "name": "get_info",
        "description": "Get runtime info (OS name), may call when user asks about local "
        "files or shell commands",
        "parameters": {"properties": {}, "required": [], "type": "object"}}},
]  # fmt: skip


def web_ui(messages: list[dict], stream: bool = True, **settings: Any) -> dict[str, Any]:
    """A chat turn of llama.cpp's web UI; `settings` are the sampling settings the
    user changed (sent as the UI sends them)."""
    body: dict[str, Any] = {
        "messages": [{"content": m["content"], "role": m["role"]} for m in messages],
        "stream": stream,
    }
    if stream:
        body |= {"return_progress": True, "sse_ping_interval": 1}
    body["tools"] = settings.pop("tools", WEB_UI_TOOLS)
    if not body["tools"]:
        del body["tools"]
    body |= {"reasoning_format": "auto", "reasoning_control": True}
    body |= {k: v for k, v in settings.items() if k != "samplers"}
    if "samplers" in settings:
        body["samplers"] = [s for s in settings["samplers"].split(";") if s.strip()]
    body |= {"backend_sampling": False, "timings_per_token": True}
    return body


def web_ui_all_settings(messages: list[dict], temperature: float) -> dict[str, Any]:
    """Every sampling setting filled in with llama-server's defaults as /props
    reports them (the UI syncs its settings from there), at the given temperature."""
    return web_ui(
        messages,
        temperature=temperature,
        max_tokens=-1,
        dynatemp_range=0,
        dynatemp_exponent=1,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        xtc_probability=0,
        xtc_threshold=0.1,
        typ_p=1,
        repeat_last_n=64,
        repeat_penalty=1,
        presence_penalty=0,
        frequency_penalty=0,
        dry_multiplier=0,
        dry_base=1.75,
        dry_allowed_length=2,
        dry_penalty_last_n=768,  # what /props reports: -1 becomes the context size
        samplers=WEB_UI_SAMPLERS,
    )


def open_webui(model: str, messages: list[dict], **params: Any) -> dict[str, Any]:
    """A chat request of Open WebUI to an OpenAI connection, with the model's
    advanced parameters `params` (only those the user set are sent)."""
    return {"stream": True, "model": model, "messages": messages, **params}


def lm_studio(model: str, messages: list[dict], **params: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **params}


# Table rows: (name, body builder taking model and messages). All greedy, so the
# answer must equal llama-server alone token for token.
def greedy_client_bodies(model: str, messages: list[dict]) -> dict[str, dict[str, Any]]:
    return {
        "web-ui-temperature-0": web_ui(messages, temperature=0),
        "web-ui-tools-off": web_ui(messages, temperature=0, tools=[]),
        "web-ui-all-settings-temperature-0": web_ui_all_settings(messages, 0),
        "web-ui-samplers-top_k-only": web_ui(messages, top_k=1, samplers="top_k"),
        "web-ui-not-streaming": web_ui(messages, stream=False, temperature=0),
        "open-webui": open_webui(model, messages, temperature=0.0),
        "open-webui-advanced": open_webui(
            model,
            messages,
            temperature=0.0,
            top_p=0.9,
            max_tokens=24,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            seed=42,
            stop=["\n\n\n"],
            stream_options={"include_usage": True},
        ),
        "open-webui-title-task": {
            "model": model,
            "messages": messages,
            "stream": False,
            "temperature": 0.0,
        },
        "lm-studio": lm_studio(
            model, messages, temperature=0, max_tokens=-1, stream=False, ttl=300
        ),
        "lm-studio-streaming": lm_studio(
            model,
            messages,
            temperature=0,
            top_k=40,
            top_p=0.95,
            repeat_penalty=1.0,
            presence_penalty=0,
            frequency_penalty=0,
            logit_bias={},
            seed=-1,
            stream=True,
            stop=[],
        ),
    }
