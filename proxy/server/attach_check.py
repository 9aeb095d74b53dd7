"""Attached mode: is a running llama-server set up for one-decode verification?

`check_upstream` returns findings, each naming the exact flag to change; the serve
command refuses (or degrades) on errors, and `npu-spec doctor --upstream` prints them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import aiohttp

from proxy.server.local_server import kv_unified, local_server_command
from proxy.server.managed import ServerLayout, verification_flags
from proxy.server.upstream import UpstreamClient, UpstreamClientError, UpstreamError
from proxy.user_errors import UserError

Severity = Literal["error", "warning", "ok"]


@dataclass(frozen=True)
class Finding:
    severity: Severity
    message: str
    fix: str | None = None  # the llama-server flag to add or change


PROBE_PROMPT = "npu-spec attach check: one decode per verify round. " * 8


@dataclass(frozen=True)
class ProbeRound:
    decodes: int  # llamacpp:n_decode_total delta
    prompt_tokens: int  # llamacpp:prompt_tokens_total delta: tokens the slots ingested
    bound: int  # most tokens a correctly set-up server ingests in this round


async def _probe_rounds(upstream: UpstreamClient, k: int, rounds: int = 3) -> list[ProbeRound]:
    """Verify rounds as the engine runs them, drafting the server's own greedy tokens.

    Measured on b11434: n_decode_total grows by one per round whatever the flags
    (llama_decode splits a non-unified batch internally), so the telling number is
    prompt_tokens_total: with idle-slot caching on, every round re-prefills most
    slots (hundreds of tokens instead of about (k+1) x accepted).
    """
    context = await upstream.tokenize(PROBE_PROMPT)
    truth = await upstream.completion(
        {"prompt": context, "n_predict": rounds * (k + 1), "temperature": 0.0,
         "return_tokens": True, "cache_prompt": True}
    )  # fmt: skip
    tokens = truth["tokens"]
    out: list[ProbeRound] = []
    before = await upstream.metrics()
    committed_last = len(context)
    for r in range(rounds):
        done = r * (k + 1)  # every draft is right: each round commits k+1 tokens
        await upstream.verify(context + tokens[:done], tokens[done : done + k])
        after = await upstream.metrics()
        out.append(
            ProbeRound(
                decodes=int(after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"]),
                prompt_tokens=int(
                    after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
                ),
                bound=(k + 1) * committed_last + k * (k + 1) // 2,
            )
        )
        committed_last = k + 1
        before = after
    return out


SPEC_HEADER = "X-Npu-Spec"  # on every response of the npu-spec proxy


async def is_npu_spec_proxy(base_url: str) -> bool:
    """Whether `base_url` is an npu-spec proxy: its answers carry X-Npu-Spec."""
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(base_url + "/health") as response,
        ):
            return SPEC_HEADER in response.headers
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return False  # the health check below reports an unreachable server


def _unified_kv_finding(command: tuple[Sequence[str], Mapping[str, str]] | None) -> Finding:
    if command is None:
        # /props does not say whether the KV cache is unified, and the batch split
        # it causes happens inside one llama_decode: only the command line tells.
        return Finding(
            "warning",
            "cannot see llama-server's command line (not a process on this machine), so "
            "cannot check unified KV; without it each round costs about k+1 passes",
            "-kvu",
        )
    if kv_unified(*command):
        return Finding("ok", "unified KV cache on (llama-server's command line)")
    return Finding(
        "warning",
        "llama-server runs without a unified KV cache: each round costs about k+1 passes",
        "-kvu",
    )


class NothingListening(UserError):
    """Nothing accepts connections at the upstream URL: no flag can fix that."""

    def __init__(self, base_url: str, reason: str) -> None:
        super().__init__(
            f"nothing answers at {base_url} ({reason}): is llama-server running there?",
            "start llama-server, or give --upstream the URL it listens on",
        )


def _connection_failure(base_url: str, exc: UpstreamError) -> NothingListening | None:
    cause = exc.__cause__
    if not isinstance(cause, aiohttp.ClientConnectorError):
        return None
    code = cause.os_error.errno
    reason = os.strerror(code).lower() if code else str(cause.os_error)
    return NothingListening(base_url, reason)


async def check_upstream(
    base_url: str,
    k: int,
    conversations: int = 1,
    api_key: str | None = None,
    server_command: tuple[Sequence[str], Mapping[str, str]] | None = None,
) -> list[Finding]:
    """Findings about the llama-server at `base_url`, every one in one pass (a flag
    that stops one check does not hide the others); `server_command` (argv and
    environment) where the caller knows how it was started, else read from /proc
    when it runs on this machine. Raises NothingListening when nothing answers."""
    if await is_npu_spec_proxy(base_url):
        return [
            Finding(
                "error",
                f"{base_url} is an npu-spec proxy (its answers carry {SPEC_HEADER}), "
                "not llama-server",
                "point --upstream at the llama-server behind the proxy",
            )
        ]
    if server_command is None:
        server_command = await asyncio.to_thread(local_server_command, base_url)
    findings: list[Finding] = []
    async with UpstreamClient(base_url, api_key=api_key) as upstream:
        try:
            await upstream.health()
        except (UpstreamError, UpstreamClientError) as exc:
            unreachable = (
                _connection_failure(base_url, exc) if isinstance(exc, UpstreamError) else None
            )
            if unreachable is not None:
                raise unreachable from None
            return [Finding("error", f"llama-server not healthy: {exc}")]
        findings.append(Finding("ok", f"llama-server at {base_url} is healthy"))
        props = await upstream.props()
        slots = int(props.get("total_slots", 1))
        findings.append(_slots_finding(slots, k, conversations))
        n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx", 0))
        findings.append(Finding("ok", f"context per slot: {n_ctx} tokens"))
        metrics_on = bool(props.get("endpoint_metrics", False))
        if not metrics_on:
            findings.append(
                Finding(
                    "error",
                    "/metrics is off: the one-decode-per-round check cannot run",
                    "--metrics",
                )
            )
        if metrics_on and slots >= k + 1:
            try:
                rounds = await _probe_rounds(upstream, k)
            except (UpstreamError, UpstreamClientError, KeyError) as exc:
                findings.append(Finding("error", f"verify probe failed: {exc!r}"))
            else:
                findings.append(_rounds_finding(rounds[1:]))
        else:
            findings.append(_unprobed_finding(server_command))
        findings.append(await _slot_save_finding(upstream))
        findings.append(_unified_kv_finding(server_command))
    return findings


# flags verification_flags sets -> whether each takes a value (b11434's spellings)
_VERIFICATION_FLAGS = {
    "-np": True, "--parallel": True, "-c": True, "--ctx-size": True,
    "--kv-unified-per-slot": True, "-kvu": False, "--kv-unified": False, "-no-kvu": False,
    "--no-kv-unified": False, "--no-cache-idle-slots": False, "--cache-idle-slots": False,
    "-cram": True, "--cache-ram": True, "--metrics": False, "--slot-save-path": True,
}  # fmt: skip
DEFAULT_SLOT_DIR = Path("/tmp/npu-spec-slots")


def _own_arguments(argv: Sequence[str]) -> tuple[list[str], Path | None]:
    """The server's arguments without those verification sets, and its slot folder."""
    kept: list[str] = []
    slot_dir: Path | None = None
    items = iter(argv)
    for arg in items:
        flag, has_value, value = arg.partition("=")
        if flag not in _VERIFICATION_FLAGS:
            kept.append(arg)
            continue
        if _VERIFICATION_FLAGS[flag] and not has_value:
            value = next(items, "")
        if flag == "--slot-save-path" and value:
            slot_dir = Path(value)
    return kept, slot_dir


@dataclass(frozen=True)
class RestartCommand:
    argv: list[str]
    ctx: int  # context per conversation: the server's current context per slot
    own_flags_known: bool  # False: the server's own flags (-ngl, ...) are not in argv


async def restart_command(
    base_url: str,
    k: int,
    conversations: int = 1,
    api_key: str | None = None,
    server_command: tuple[Sequence[str], Mapping[str, str]] | None = None,
) -> RestartCommand:
    """The one llama-server command line that passes every check for this k: the
    server's own command (read on this machine; else its model and port) with the
    verification flags for its current context per slot in place of any it had."""
    if server_command is None:
        server_command = await asyncio.to_thread(local_server_command, base_url)
    async with UpstreamClient(base_url, api_key=api_key) as upstream:
        props = await upstream.props()
    ctx = int(props.get("default_generation_settings", {}).get("n_ctx", 0)) or 4096
    if server_command is not None:
        own, slot_dir = _own_arguments(server_command[0])
    else:
        port = urlsplit(base_url).port or 8080
        own, slot_dir = ["llama-server", "-m", str(props.get("model_path", "MODEL.gguf"))], None
        own += ["--port", str(port)]
    flags = verification_flags(ServerLayout(k, ctx, conversations), slot_dir or DEFAULT_SLOT_DIR)
    return RestartCommand(own + flags, ctx, own_flags_known=server_command is not None)


def _slots_finding(slots: int, k: int, conversations: int) -> Finding:
    need = conversations * (k + 1)
    if slots < k + 1:
        return Finding(
            "error", f"{slots} slots; k={k} needs {k + 1} per conversation", f"-np {need + 1}"
        )
    if slots < need:
        return Finding(
            "warning",
            f"{slots} slots serve {slots // (k + 1)} of {conversations} "
            "conversations at once; the rest queue",
            f"-np {need + 1}",
        )
    return Finding("ok", f"{slots} slots: {slots // (k + 1)} conversations")


def _rounds_finding(later: list[ProbeRound]) -> Finding:
    """One decode per verify round and no re-prefill, judged on the rounds after
    the first (the first ingests the prompt)."""
    if any(r.decodes != 1 for r in later):
        return Finding(
            "error",
            f"verify rounds took {[r.decodes for r in later]} decodes instead of 1 each",
            "-kvu --no-cache-idle-slots -cram 0",
        )
    if any(r.prompt_tokens > r.bound for r in later):
        return Finding(
            "error",
            "every verify round re-prefills the slots ("
            + ", ".join(f"{r.prompt_tokens} tokens, expected <= {r.bound}" for r in later)
            + "): idle-slot caching wipes them",
            "--no-cache-idle-slots -cram 0",
        )
    return Finding("ok", "one llama_decode per verify round, no re-prefill")


def _unprobed_finding(command: tuple[Sequence[str], Mapping[str, str]] | None) -> Finding:
    """Without --metrics or k+1 slots the verify probe cannot run: idle-slot caching is
    then judged from the command line where it is visible."""
    argv = list(command[0]) if command is not None else []
    has_flags = "--no-cache-idle-slots" in argv and any(
        arg in ("-cram", "--cache-ram") and value == "0"
        for arg, value in zip(argv, [*argv[1:], ""], strict=True)
    )
    if has_flags:
        return Finding("ok", "idle-slot caching off (llama-server's command line)")
    return Finding(
        "warning",
        "verify probe not run (it needs --metrics and k+1 slots); unless idle-slot caching "
        "is off, every round re-prefills the slots",
        "--no-cache-idle-slots -cram 0",
    )


async def _slot_save_finding(upstream: UpstreamClient) -> Finding:
    try:
        await upstream.slot_action(0, "save", "npu-spec-attach-check.bin")
    except (UpstreamError, UpstreamClientError) as exc:
        return Finding(
            "warning",
            f"slot save/restore unavailable ({exc}): a cold start prefills k+1 slots",
            "--slot-save-path DIR",
        )
    return Finding("ok", "slot save/restore on: cold starts prefill once")
