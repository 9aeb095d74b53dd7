"""Proxy settings: one model, three sources with the same names.

Precedence: command-line options > environment variables (`NPU_SPEC_<NAME>`) >
config file (TOML or JSON, `--config PATH` or `NPU_SPEC_CONFIG`) > defaults.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# the words a switch setting takes, and the modes they mean for a measured one
_SWITCH_WORDS = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}


class ProxySettings(BaseSettings):
    # hide_input_in_errors: a rejected value may be a key or a URL with a password
    model_config = SettingsConfigDict(
        env_prefix="NPU_SPEC_", extra="forbid", hide_input_in_errors=True
    )

    # where the target runs: exactly one of the two
    target: Path | None = Field(None, description="GGUF model: start llama-server (managed)")
    upstream: str | None = Field(None, description="URL of a running llama-server (attached)")

    drafter: str | None = Field(None, description="drafter folder, or 'ngram'; none: plain")
    provider: str = Field("auto", description="execution provider for the drafter")
    drafter_threads: int | None = Field(
        None, ge=1, description="CPU threads for the drafter (default: all this process may use)"
    )
    k: int = Field(4, ge=0, le=16, description="most draft tokens per round")
    adaptive_k: bool = Field(True, description="choose each round's draft length (else k)")
    draft_length: Literal["formula", "uniform", "marginal"] = Field(
        "formula",
        description="how the adaptive draft length is chosen: formula (the lengths that "
        "maximise expected tokens per expected round time, counting only drafting that is "
        "not hidden under verification; one for rounds whose drafts were drafted ahead, one "
        "for rounds that draft fresh), uniform (one such length for all rounds) or marginal "
        "(position by position from the draft's confidence)",
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="draft while the server verifies: auto (measured per round), on, off"
    )
    early_draft: bool = Field(
        True,
        description="start the next round's draft as soon as a verify result is back, while "
        "the proxy commits the round's tokens (else when the next round starts)",
    )
    runner_up_lines: bool = Field(
        True,
        description="while the server verifies and time is left, also draft the lines after "
        "the draft's runner-ups at its likeliest misses, so that the round after such a miss "
        "finds its draft ready",
    )
    send_ahead: bool = Field(
        True,
        description="draft and send the next round's verification as soon as a verify result "
        "is back, before the proxy streams and records the round's tokens",
    )
    pad_rounds: Literal["auto", "on", "off"] = Field(
        "auto",
        description="pad every verify round of the same length as the last to one batch "
        "shape with one more prompt in a spare slot, so that llama-server reuses its compute "
        "graph and its CUDA backend replays it (greedy, one generation on the server): auto "
        "(measured against unpadded rounds, kept where it pays), on, off",
    )
    slot_file_reuse: bool = Field(
        True,
        description="a generation restores the slot file it saved earlier, as it is, where "
        "the measured rates say a new save costs more than prefilling what the file lacks",
    )
    copy_by_cost: bool = Field(
        True,
        description="copy a slot only where, at the measured save, restore and prefill "
        "rates, the copy costs less than letting the slots prefill what they lack inside "
        "the next verify batch (off: wherever they lack enough tokens)",
    )
    clear_stale_copies: bool = Field(
        True,
        description="empty idle slots whose contents would slow every decode (unified KV "
        "attends over every cell in use): before a generation's first prefill, the copies "
        "and spread contexts of another conversation that ended generations left; after a "
        "pass-through with no other stream, every context but the one the server used last",
    )
    backend_sampling: bool = Field(
        False,
        description="greedy verify rounds and plain runs ask llama-server to pick each "
        "token on the device that holds the logits (its experimental backend sampling, "
        "per request) instead of copying every prompt's logits to the host and sampling "
        "there, one prompt after another",
    )
    plain_runs: Literal["auto", "off"] = Field(
        "auto",
        description="let llama-server decode alone while that is measured to be faster than "
        "speculating (auto), or always speculate (off)",
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)

    # managed mode only
    llama_server: Path | None = Field(None, description="llama-server binary")
    ctx: int = Field(4096, ge=64, description="context per conversation (tokens)")
    conversations: int = Field(1, ge=1, description="concurrent speculative conversations")
    passthrough_slots: int = Field(1, ge=0, description="extra slots for passed-through requests")
    threads: int | None = Field(None, ge=1, description="llama-server -t")
    server_host: str = "127.0.0.1"
    server_port: int | None = None
    slot_save_dir: Path | None = None
    server_args: list[str] = Field(default_factory=list, description="extra llama-server args")
    server_log: Path | None = None

    # behaviour
    when_busy: Literal["queue", "passthrough"] = "queue"
    under_load: Literal["auto", "plain"] = Field(
        "auto",
        description="with other streams on the server: speculate where measured to beat "
        "llama-server's batching of them all (auto), or never (plain)",
    )
    max_streams: int | None = Field(
        None, ge=1, description="requests served at once (default: llama-server's slots)"
    )
    queue_timeout_s: float = Field(300.0, gt=0)
    verify_timeout_s: float = Field(600.0, gt=0)
    check_decodes: bool = Field(False, description="check one server decode per round")
    log_rounds: bool = Field(
        False,
        description="log one line per round: its drafts, times, and each prompt's slot, "
        "tokens ingested and server time (for diagnosis)",
    )
    strict_decodes: bool = Field(False, description="fail a request whose round decodes != 1")
    attach_policy: Literal["refuse", "degrade"] = "refuse"

    # reliability and security (docs/RELIABILITY.md)
    api_key: str | None = Field(None, description="clients must send Authorization: Bearer KEY")
    upstream_api_key: str | None = Field(
        None, description="key sent to llama-server, replacing the client's; unset: forwarded"
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    max_queue: int = Field(32, ge=0, description="requests waiting for a slot group; then 503")
    retry_after_s: int = Field(2, ge=1, description="Retry-After sent with a 503")
    allow_slot_actions: bool = Field(True, description="pass /slots/{id}?action=... through")
    passthrough_read_timeout_s: float = Field(
        600.0, gt=0, description="longest silence from llama-server on a passed-through answer"
    )
    draft_timeout_s: float = Field(30.0, gt=0, description="a drafter slower than this failed")
    restart_server: bool = Field(True, description="managed: restart a llama-server that died")
    max_restarts: int = Field(5, ge=0, description="managed: restarts allowed per 10 minutes")

    @field_validator("pad_rounds", mode="before")
    @classmethod
    def _pad_switch(cls, value: object) -> object:
        """`pad_rounds` was a switch before it was measured: true and false still mean on
        and off (a config file's `pad_rounds = true`)."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in _SWITCH_WORDS:
            return _SWITCH_WORDS[value.lower()]
        return value

    @field_validator("upstream")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        return None if url is None else normalize_upstream_url(url)

    @model_validator(mode="after")
    def _one_target(self) -> ProxySettings:
        if (self.target is None) == (self.upstream is None):
            raise ValueError(ONE_TARGET)
        if self.upstream is not None and urlsplit(self.upstream).password is not None:
            # it would show in logs and error messages: keys go in upstream_api_key
            raise ValueError("put the upstream's key in upstream_api_key, not in the URL")
        return self

    def __repr_args__(self):  # keys never reach logs or tracebacks
        for name, value in super().__repr_args__():
            yield name, ("***" if name in SECRET_FIELDS and value else value)


SECRET_FIELDS = frozenset({"api_key", "upstream_api_key"})
ONE_TARGET = (
    "give exactly one of --target MODEL.gguf (the proxy starts llama-server) or "
    "--upstream URL (attach to a llama-server you run)"
)


def normalize_upstream_url(url: str) -> str:
    """`url` with http:// added when it has no scheme ("localhost:8081"); any scheme
    other than http or https is refused with a hint."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"upstream must be an http:// or https:// URL such as http://127.0.0.1:8081, "
            f"not {parts.scheme}://..."
        )
    return url


def settings_error_lines(error: ValidationError, flags: dict[str, str] | None = None) -> list[str]:
    """One line per problem, naming the option (`flags`: setting -> command-line flag)
    and its environment variable."""
    lines = []
    for problem in error.errors():
        message = str(problem["msg"]).removeprefix("Value error, ")
        if problem["loc"]:
            name = str(problem["loc"][0])
            shown = (flags or {}).get(name, name)
            message = f"{shown} (NPU_SPEC_{name.upper()}): {message}"
        lines.append(message)
    return lines


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as error:  # tomllib and json errors are ValueErrors
        raise ConfigFileError(f"config file {path}: {error}") from None
    # allow `llama-server = ...` as well as `llama_server = ...`
    return {str(key).replace("-", "_"): value for key, value in data.items()}


class ConfigFileError(ValueError):
    """A config file that is missing or does not parse."""


def load_settings(
    cli_values: dict[str, Any], config_path: str | os.PathLike[str] | None = None
) -> ProxySettings:
    """Merge the sources; `cli_values` holds only options the user actually gave."""
    config_path = config_path or os.environ.get("NPU_SPEC_CONFIG")
    file_values = read_config_file(config_path) if config_path else {}
    env_names = {
        name for name in ProxySettings.model_fields if f"NPU_SPEC_{name.upper()}" in os.environ
    }
    # file < env: drop file values the environment overrides, then let pydantic-settings
    # read the environment; explicit init values (CLI) beat the environment.
    merged = {k: v for k, v in file_values.items() if k not in env_names}
    merged.update(cli_values)
    return ProxySettings(**merged)
