"""`npu-spec serve`: the speculative proxy, managed (--target) or attached (--upstream)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import secrets
import shlex
import shutil
import signal
import socket
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web
from pydantic import ValidationError

from npu_draft.load import parse_ngram_spec
from proxy import native_memory
from proxy.config import ConfigFileError, ProxySettings, load_settings, settings_error_lines
from proxy.server.llama_server import (
    LlamaServerNotFound,
    LlamaServerProcess,
    LlamaServerStartError,
    find_llama_server,
)
from proxy.server.managed import ServerLayout, ServerSupervisor, managed_server, write_key_file
from proxy.server.upstream import Timeouts, UpstreamClient, UpstreamClientError, UpstreamError
from proxy.user_errors import UserError

log = logging.getLogger(__name__)

# option -> settings field; every option defaults to "not given" so the environment
# and the config file can supply it. Help texts that end in "(default: ...)" get the
# default from ProxySettings, so help and behaviour cannot disagree.
_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (
        ("--target",),
        {
            "metavar": "GGUF",
            "help": "managed mode: the GGUF model; the proxy starts llama-server "
            "with the flags verification needs and stops it on exit (give this or --upstream)",
        },
    ),
    (
        ("--upstream",),
        {
            "metavar": "URL",
            "help": "attached mode: URL of a llama-server you run, e.g. "
            "http://127.0.0.1:8081 (http:// is assumed without a scheme; give this or --target)",
        },
    ),
    (
        ("--drafter",),
        {
            "metavar": "DRAFTER",
            "help": "drafter folder (exported ONNX or ONNX Runtime GenAI), "
            "'ngram[:sizes]' (prompt lookup, no model) or 'FOLDER+ngram'; none: every request "
            "passes through (default: %(default)s)",
        },
    ),
    (
        ("--provider",),
        {
            "choices": ["auto", "npu", "cuda", "cpu"],
            "help": "where the drafter runs; auto tries "
            "the NPU, then CUDA, then the CPU (default: %(default)s)",
        },
    ),
    (
        ("--drafter-threads",),
        {
            "type": int,
            "metavar": "N",
            "dest": "drafter_threads",
            "help": "CPU threads for the drafter (default: all cores this process may use)",
        },
    ),
    (
        ("-k",),
        {
            "type": int,
            "metavar": "N",
            "dest": "k",
            "help": "most draft tokens per round, 0-16 (default: %(default)s)",
        },
    ),
    (
        ("--fixed-k",),
        {
            "action": "store_false",
            "dest": "adaptive_k",
            "help": "always draft k tokens (default: choose per round, up to k)",
        },
    ),
    (
        ("--draft-length",),
        {
            "choices": ["formula", "uniform", "marginal"],
            "dest": "draft_length",
            "help": "adaptive draft length: formula (the lengths with the most expected "
            "tokens per expected round time, from measured acceptance, drafting speed and "
            "per-length verify costs, counting only drafting not hidden by drafting ahead: "
            "one for rounds whose drafts were drafted ahead, a shorter one for rounds that "
            "draft fresh), uniform (one such length) or marginal (position by position from "
            "the draft's own confidence) (default: %(default)s)",
        },
    ),
    (
        ("--overlap",),
        {
            "choices": ["auto", "on", "off"],
            "dest": "overlap",
            "help": "draft while the server verifies: auto (measured, kept where it pays), "
            "on, off (default: %(default)s)",
        },
    ),
    (
        ("--no-overlap",),
        {"action": "store_const", "const": "off", "dest": "overlap", "help": "--overlap off"},
    ),
    (
        ("--early-draft",),
        {
            "choices": ["on", "off"],
            "dest": "early_draft",
            "help": "on: start the next round's draft as soon as a verify result is back, "
            "while the proxy commits the round's tokens; off: when the next round starts "
            "(default: %(default)s)",
        },
    ),
    (
        ("--send-ahead",),
        {
            "choices": ["on", "off"],
            "dest": "send_ahead",
            "help": "on: draft and send the next round's verification as soon as a verify "
            "result is back, before the proxy streams and records the round's tokens; off: "
            "after them (default: %(default)s)",
        },
    ),
    (
        ("--pad-rounds",),
        {
            "choices": ["auto", "on", "off"],
            "dest": "pad_rounds",
            "help": "pad every verify round of the same length as the last to one batch "
            "shape, with one more prompt in a spare slot, so that llama-server reuses its "
            "compute graph (CUDA graphs replay it): auto (measured against unpadded rounds, "
            "kept where it pays), on, off (default: %(default)s)",
        },
    ),
    (
        ("--runner-up-lines",),
        {
            "choices": ["on", "off"],
            "dest": "runner_up_lines",
            "help": "on: while the server verifies and time is left, also draft the lines "
            "after the draft's runner-ups at its likeliest misses; off: only the line with "
            "every draft accepted (default: %(default)s)",
        },
    ),
    (
        ("--slot-file-reuse",),
        {
            "choices": ["on", "off"],
            "dest": "slot_file_reuse",
            "help": "on: a generation that copies its slot again restores the file it saved "
            "before, as it is, where the measured rates say a new save costs more than "
            "prefilling what the file lacks; off: always save anew (default: %(default)s)",
        },
    ),
    (
        ("--copy-by-cost",),
        {
            "choices": ["on", "off"],
            "dest": "copy_by_cost",
            "help": "on: copy a slot only where, at the measured save, restore and prefill "
            "rates, the copy costs less than letting the slots prefill what they lack "
            "inside the next verify batch (a later chat turn whose slots hold most of it "
            "prefills the rest); off: copy wherever the slots lack at least 64 tokens "
            "(default: %(default)s)",
        },
    ),
    (
        ("--backend-sampling",),
        {
            "choices": ["on", "off"],
            "dest": "backend_sampling",
            "help": "on: greedy verify rounds and plain runs ask llama-server to pick each "
            "token on the device that holds the logits (its experimental backend sampling, "
            "per request), not on the host one prompt after another; the same argmax either "
            "way (default: %(default)s)",
        },
    ),
    (
        ("--clear-stale-copies",),
        {
            "choices": ["on", "off"],
            "dest": "clear_stale_copies",
            "help": "on: empty idle slots whose contents would slow every decode (with "
            "unified KV a decode attends over every cell in use): before a generation's "
            "first prefill, the copies and spread contexts of another conversation that "
            "ended generations left; after a pass-through with no other stream, every "
            "context but the one the server used last; off: keep them (default: %(default)s)",
        },
    ),
    (
        ("--plain-runs",),
        {
            "choices": ["auto", "off"],
            "dest": "plain_runs",
            "help": "auto: while speculating costs more per token than letting llama-server "
            "decode alone (both measured), requests go on in plain runs (seeded sampling "
            "requests always speculate); off: always speculate (default: %(default)s)",
        },
    ),
    (("--host",), {"help": "address the proxy listens on (default: %(default)s)"}),
    (("--port",), {"type": int, "help": "port the proxy listens on (default: %(default)s)"}),
    (
        ("--llama-server",),
        {
            "metavar": "PATH",
            "dest": "llama_server",
            "help": "managed: the llama-server binary "
            "(default: $LLAMA_SERVER, then llama-server on PATH, then `npu-spec install-server`'s)",
        },
    ),
    (
        ("--ctx",),
        {
            "type": int,
            "metavar": "TOKENS",
            "help": "managed: context per conversation; every "
            "one of its k+1 slots gets this much KV cache (default: %(default)s)",
        },
    ),
    (
        ("--conversations",),
        {
            "type": int,
            "metavar": "N",
            "help": "managed: speculative conversations at once, "
            "k+1 slots each (default: %(default)s); attached: the number to check slots for",
        },
    ),
    (
        ("--passthrough-slots",),
        {
            "type": int,
            "metavar": "N",
            "dest": "passthrough_slots",
            "help": "managed: extra slots for requests that pass through (default: %(default)s)",
        },
    ),
    (
        ("--threads",),
        {
            "type": int,
            "metavar": "N",
            "help": "managed: llama-server -t (default: llama-server's own choice)",
        },
    ),
    (
        ("--server-port",),
        {
            "type": int,
            "metavar": "PORT",
            "dest": "server_port",
            "help": "managed: port for llama-server on 127.0.0.1 (default: a free one)",
        },
    ),
    (
        ("--server-log",),
        {
            "metavar": "FILE",
            "dest": "server_log",
            "help": "managed: append llama-server's log to FILE (default: discarded)",
        },
    ),
    (
        ("--server-arg",),
        {
            "action": "extend",
            "type": shlex.split,
            "metavar": "'ARGS'",
            "dest": "server_args",
            "help": "managed: more llama-server arguments, split like a shell line; "
            "repeatable: --server-arg '-ngl 99' --server-arg=--no-mmap (default: none)",
        },
    ),
    (
        ("--when-busy",),
        {
            "choices": ["queue", "passthrough"],
            "dest": "when_busy",
            "help": "when every llama-server slot serves a stream: wait in the bounded queue "
            "(queue) or pass the request on for llama-server to queue (passthrough) "
            "(default: %(default)s)",
        },
    ),
    (
        ("--under-load",),
        {
            "choices": ["auto", "plain"],
            "dest": "under_load",
            "help": "with several streams at once: speculate only where measured to beat "
            "llama-server's own batching of them (auto), or let every stream decode "
            "plainly while others are served (plain) (default: %(default)s)",
        },
    ),
    (
        ("--check-decodes",),
        {
            "action": "store_true",
            "dest": "check_decodes",
            "help": "check through "
            "llamacpp:n_decode_total that every round costs one server decode (default: off)",
        },
    ),
    (
        ("--log-rounds",),
        {
            "action": "store_true",
            "dest": "log_rounds",
            "help": "log one line per round: its drafts, times, and each prompt's slot, "
            "tokens ingested and server time (default: off)",
        },
    ),
    (
        ("--attach-policy",),
        {
            "choices": ["refuse", "degrade"],
            "dest": "attach_policy",
            "help": "attached: when the server's flags cannot verify in one decode, refuse to "
            "start or degrade to passing everything through (default: %(default)s)",
        },
    ),
    # Keys on the command line are visible to other local users (ps): prefer
    # NPU_SPEC_API_KEY / NPU_SPEC_UPSTREAM_API_KEY or the config file.
    (
        ("--api-key",),
        {
            "metavar": "KEY",
            "dest": "api_key",
            "help": "require Authorization: Bearer KEY "
            "(default: none; prefer NPU_SPEC_API_KEY: a command line shows in ps)",
        },
    ),
    (
        ("--upstream-api-key",),
        {
            "metavar": "KEY",
            "dest": "upstream_api_key",
            "help": "key the proxy sends to llama-server (default: attached, clients' keys "
            "are forwarded; managed, a random one when --api-key is set, else none)",
        },
    ),
    (
        ("--max-body-bytes",),
        {
            "type": int,
            "metavar": "N",
            "dest": "max_body_bytes",
            "help": "larger request bodies get 413 (default: %(default)s)",
        },
    ),
    (
        ("--max-queue",),
        {
            "type": int,
            "metavar": "N",
            "dest": "max_queue",
            "help": "requests waiting for a slot group; more get 503 + Retry-After "
            "(default: %(default)s)",
        },
    ),
    (
        ("--no-slot-actions",),
        {
            "action": "store_false",
            "dest": "allow_slot_actions",
            "help": "refuse clients' /slots save, restore and erase (default: passed through)",
        },
    ),
    (
        ("--draft-timeout",),
        {
            "type": float,
            "metavar": "SECONDS",
            "dest": "draft_timeout_s",
            "help": "a drafter slower than this counts as failed and is re-created "
            "(default: %(default)s)",
        },
    ),
    (
        ("--verify-timeout",),
        {
            "type": float,
            "metavar": "SECONDS",
            "dest": "verify_timeout_s",
            "help": "longest wait for one verify round from llama-server (default: %(default)s)",
        },
    ),
    (
        ("--no-restart-server",),
        {
            "action": "store_false",
            "dest": "restart_server",
            "help": "managed: do not restart a llama-server that died (default: restart, at most "
            "max_restarts times per 10 minutes)",
        },
    ),
]

EPILOG = """\
Every option is also the environment variable shown in [brackets] and a key of a TOML
or JSON file given with --config FILE (or NPU_SPEC_CONFIG): the variable's name without
NPU_SPEC_, in lower case (k = 4, drafter = "/models/drafter", server_args = ["-ngl",
"99"]; a list in a variable is JSON: NPU_SPEC_SERVER_ARGS='["-ngl", "99"]'). The
command line beats the environment, which beats the file. Settings with no option of
their own: queue_timeout_s, max_streams, strict_decodes, retry_after_s, passthrough_read_timeout_s,
max_restarts, server_host, slot_save_dir. docs/QUICKSTART.md lists every setting with
its default.

--server-arg takes a shell-like line, so a flag and its value go together; a flag
alone needs "=" (else it reads as an option of npu-spec):
  npu-spec serve --target model.gguf --server-arg '-ngl 99' --server-arg=--no-mmap
"""

# settings field -> the flag that sets it, for error messages
FLAGS: dict[str, str] = {}
for _flags, _options in _OPTIONS:  # the first option of a setting names it (--overlap)
    FLAGS.setdefault(_options.get("dest", _flags[0].lstrip("-").replace("-", "_")), _flags[0])


def _help(options: dict[str, Any], dest: str) -> dict[str, Any]:
    """The help with "%(default)s" filled from the settings (argparse's default is
    None, meaning "not given") and the environment variable that sets the same."""
    help_text = options.get("help", "")
    if "%(default)s" in help_text:
        default = ProxySettings.model_fields[dest].default
        if isinstance(default, bool):
            default = "on" if default else "off"
        help_text = help_text.replace("%(default)s", "none" if default is None else str(default))
    value = {"store_true": "=true", "store_false": "=false"}.get(options.get("action", ""), "")
    if options.get("action") == "store_const":
        value = f"={options['const']}"
    return {**options, "help": f"{help_text} [NPU_SPEC_{dest.upper()}{value}]"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML or JSON file of settings, named as below [NPU_SPEC_CONFIG]",
    )
    for flags, options in _OPTIONS:
        dest = options.get("dest", flags[0].lstrip("-").replace("-", "_"))
        parser.add_argument(*flags, **{**_help(options, dest), "default": None})


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    fields = ProxySettings.model_fields
    given = {
        name: value for name, value in vars(args).items() if name in fields and value is not None
    }
    return load_settings(given, getattr(args, "config", None))


def check_before_start(settings: ProxySettings) -> None:
    """Mistakes found in a moment, before llama-server starts or the drafter loads."""
    if settings.target is not None:
        target = Path(settings.target).expanduser()
        if not target.is_file():
            raise UserError(
                f"target model {target} does not exist",
                "give --target the path of a .gguf file",
            )
        try:
            find_llama_server(settings.llama_server)
        except LlamaServerNotFound as error:
            raise UserError(str(error)) from None
    if settings.drafter:
        folder = settings.drafter.removesuffix("+ngram")
        if parse_ngram_spec(folder) is None and not Path(folder).expanduser().is_dir():
            raise UserError(
                f"drafter {folder} is not a folder",
                "give --drafter an exported drafter folder (npu-spec export-drafter), "
                "'ngram', or leave it out",
            )
    _check_port_free(settings.host, settings.port, "--port")
    if settings.target is not None and settings.server_port:
        _check_port_free(settings.server_host, settings.server_port, "--server-port")


def _check_port_free(host: str, port: int, flag: str) -> None:
    if port == 0:  # the system picks one
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise UserError(f"cannot listen on {host}: {error.strerror}", "fix --host") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as asyncio's server does: a port in TIME_WAIT is free, one that listens is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {port} on {host} is already in use",
                    f"{flag} with a free port, or stop what listens there",
                ) from None
            raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as error:
        raise UserError("; ".join(settings_error_lines(error, FLAGS))) from None
    except ConfigFileError as error:
        raise UserError(str(error)) from None
    check_before_start(settings)
    if settings.log_rounds:
        from proxy.engine.rounds import ROUND_LOG

        logging.getLogger(ROUND_LOG).setLevel(logging.DEBUG)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 0
    except LlamaServerStartError as error:
        raise UserError(str(error)) from None


async def target_tokenizer_facts(upstream: Any) -> Any:
    """The target's tokenizer facts, read from the running server:
    vocabulary size, BOS/EOS ids and the ids of the shared probe text."""
    from npu_draft.tokenizer_check import PROBE_TEXT, target_facts

    props = await upstream.props()
    models = await upstream.models()
    meta = (models.get("data") or [{}])[0].get("meta") or {}

    async def special_id(text: str | None) -> int | None:
        if not text:
            return None
        ids = await upstream.tokenize(text, add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    eos = await special_id(props.get("eos_token"))
    return target_facts(
        name=str(props.get("model_path") or props.get("model_alias") or upstream.base_url),
        vocab_size=meta.get("n_vocab"),
        bos_token_id=await special_id(props.get("bos_token")),
        eos_token_ids=[] if eos is None else [eos],
        probe_ids=await upstream.tokenize(PROBE_TEXT, add_special=False, parse_special=True),
    )


def _drafter_reloader(loaded: LoadedDrafter) -> Callable[[], Callable[[], Any]]:
    """After a drafter failure: load the model again (a crashed NPU session may leave
    the old one unusable) and hand back a fresh session opener. Runs in a thread. (A
    seam of its own: scripts/soak.py wraps it to inject faults.)"""
    return loaded.reload


class LoadedDrafter:
    """The configured drafter, loaded: the only holder of the current model.

    Sessions open on whatever model is current (`open_session`); `reload` loads the
    model again and makes the new one current. The model it replaces is not closed
    here, because sessions of requests in flight still draft on it; nothing else refers
    to it, so it is freed with the last of them. (Issue 30: the opener closure kept
    in ProxyState and the model kept for shutdown held the first model for the
    proxy's whole life, one model's worth of RSS, 250-300 MiB for the 320 MB test
    drafter, from the first re-creation on.)
    """

    def __init__(self, settings: ProxySettings, target: Any = None) -> None:
        self._settings, self._target = settings, target
        self.model = _load_model(settings, target)

    def open_session(self) -> Any:
        from proxy.engine import AsyncSessionDrafter

        return AsyncSessionDrafter(self.model.open_session())

    def reload(self) -> Callable[[], Any]:
        """Load the drafter again and make it current; the session opener (blocking)."""
        old, self.model = self.model, _load_model(self._settings, self._target)
        if old is not None:  # when its last session lets it go: its memory to the system
            finalizer = weakref.finalize(old, native_memory.trim_soon, "replaced drafter freed")
            finalizer.atexit = False
        return self.open_session

    def close(self) -> None:
        """At exit: close the current model (sessions still open on it end first)."""
        model, self.model = self.model, None
        if model is not None:
            model.close()


def _load_model(settings: ProxySettings, target: Any) -> Any:
    """The configured drafter's model, loaded and warmed up; with `target` facts, a
    drafter built for another tokenizer is refused."""
    from npu_draft.async_session import run_on_worker
    from npu_draft.load import load_drafter
    from npu_draft.warmup import warm_up

    options = {"threads": settings.drafter_threads} if settings.drafter_threads else {}
    model = load_drafter(settings.drafter, settings.provider, target=target, **options)
    log.info(
        "drafter %s: backend %s on %s", model.info.name, model.info.backend, model.info.provider
    )
    # before the gate times it: a cold session's first runs cost more, and so does a
    # thread's first run on CUDA (on a worker thread, which the first session gets)
    log.info("warmed the drafter up in %.0f ms", run_on_worker(lambda: warm_up(model)))
    native_memory.trim()  # what loading freed (file buffers, graph copies); off the loop already
    return model


def _drafter_opener(
    settings: ProxySettings, target: Any = None
) -> tuple[Callable[[], Any] | None, LoadedDrafter | None]:
    """(open a session adapter, the loaded drafter) for the configured drafter; with
    `target` facts, a drafter built for another tokenizer is refused. The opener
    refers to the LoadedDrafter, never to one model, so a reload frees the old one."""
    if not settings.drafter:
        return None, None
    loaded = LoadedDrafter(settings, target)
    return loaded.open_session, loaded


@dataclass
class _Running:
    """What serve() started, stopped in this order on the way out."""

    server: LlamaServerProcess | None = None
    supervisor: ServerSupervisor | None = None
    runner: web.AppRunner | None = None
    upstream: UpstreamClient | None = None
    drafter: LoadedDrafter | None = None  # the loaded drafter (its current model)
    temp_dirs: list[Path] = field(default_factory=list)  # slot files, the key file

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.upstream is not None:
            await self.upstream.close()
        if self.drafter is not None:
            with contextlib.suppress(Exception):
                self.drafter.close()
        if self.server is not None:
            await self.server.stop()
        for folder in self.temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)


async def serve(settings: ProxySettings, ready: asyncio.Event | None = None) -> int:
    native_memory.tune_malloc()  # before the drafter loads (its blocks' home is decided here)
    running = _Running()
    try:
        return await _serve(settings, running, ready)
    finally:
        await running.stop()


async def _serve(settings: ProxySettings, running: _Running, ready: asyncio.Event | None) -> int:
    from proxy.api import build_state, create_app

    upstream_key = settings.upstream_api_key
    if settings.target is not None:
        base_url, upstream_key = await _start_managed(settings, running)
    else:
        assert settings.upstream is not None
        base_url = settings.upstream
    # Attached without an upstream key, clients' Authorization headers are
    # forwarded as they came; the proxy's own calls then carry its own key, which
    # is what those clients had to present.
    own_key = upstream_key if upstream_key is not None else settings.api_key
    degraded = False
    if settings.target is None:
        degraded = await _check_attached(settings, base_url, own_key)
        if degraded and settings.attach_policy == "refuse":
            log.error(
                "refusing to serve speculatively; fix the flags above or pass "
                "--attach-policy degrade to pass everything through"
            )
            return 1
    running.upstream = upstream = UpstreamClient(
        base_url, Timeouts(verify=settings.verify_timeout_s), api_key=own_key,
        backend_sampling=settings.backend_sampling,
    )  # fmt: skip
    facts = await _read_tokenizer_facts(upstream)
    open_drafter, running.drafter = await _load_drafter(settings, facts)
    if degraded:  # attached with --attach-policy degrade
        open_drafter = None  # every request goes through unchanged
    supervisor = running.supervisor
    state = await build_state(
        settings,
        upstream,
        open_drafter,
        reload_drafter=(
            _drafter_reloader(running.drafter)
            if open_drafter is not None and running.drafter is not None
            else None
        ),
        replace_upstream_auth=upstream_key is not None,
        server_restarts=(lambda: supervisor.restarts) if supervisor is not None else None,
    )
    running.runner = web.AppRunner(create_app(state), handler_cancellation=True)
    await _listen(settings, running.runner, base_url)
    if ready is not None:
        ready.set()
    await _wait_for_signal()
    return 0


async def _start_managed(settings: ProxySettings, running: _Running) -> tuple[str, str | None]:
    """Start llama-server (and its supervisor); (its URL, the key the proxy sends it)."""
    assert settings.target is not None
    slot_dir = settings.slot_save_dir
    if slot_dir is None:  # slot files are ours alone: removed on exit
        slot_dir = Path(tempfile.mkdtemp(prefix="npu-spec-slots-"))
        running.temp_dirs.append(slot_dir)
    server_args = list(settings.server_args)
    upstream_key = settings.upstream_api_key
    if upstream_key is None and settings.api_key:
        # a key on the proxy means nobody should reach the managed server
        # around it: give the server a random key only the proxy knows
        upstream_key = secrets.token_urlsafe(24)
    if upstream_key is not None:
        key_dir = Path(tempfile.mkdtemp(prefix="npu-spec-key-"))
        running.temp_dirs.append(key_dir)
        server_args += ["--api-key-file", str(write_key_file(upstream_key, key_dir))]
    layout = ServerLayout(
        settings.k, settings.ctx, settings.conversations, settings.passthrough_slots
    )
    running.server = server = managed_server(
        Path(settings.target),
        layout,
        binary=settings.llama_server,
        threads=settings.threads,
        host=settings.server_host,
        port=settings.server_port,
        slot_save_dir=slot_dir,
        extra_args=server_args,
        log_path=settings.server_log,
    )
    await server.start()
    log.info("managed llama-server at %s (%d slots)", server.base_url, layout.slots)
    if settings.restart_server:
        running.supervisor = ServerSupervisor(server, settings.max_restarts)
        running.supervisor.start()
    return server.base_url, upstream_key


async def _check_attached(settings: ProxySettings, base_url: str, api_key: str | None) -> bool:
    """Log what the attached server's flags allow; True when one-decode verification
    is impossible there."""
    from proxy.server.attach_check import check_upstream, restart_command

    # nothing listening there raises NothingListening: one line, no flag to fix
    findings = await check_upstream(base_url, settings.k, settings.conversations, api_key=api_key)
    for finding in findings:
        level = logging.ERROR if finding.severity == "error" else logging.INFO
        fix = f" (fix: {finding.fix})" if finding.fix else ""
        log.log(level, "%s: %s%s", finding.severity, finding.message, fix)
    failed = any(finding.severity == "error" for finding in findings)
    if failed and any(f.severity == "error" and (f.fix or "").startswith("-") for f in findings):
        command = await restart_command(
            base_url, settings.k, settings.conversations, api_key=api_key
        )
        log.error("restart llama-server with every flag it needs: %s", shlex.join(command.argv))
    return failed


async def _read_tokenizer_facts(upstream: UpstreamClient) -> Any:
    try:
        return await target_tokenizer_facts(upstream)
    except (UpstreamError, UpstreamClientError) as error:
        raise UserError(
            f"cannot read the target's tokenizer: {error}",
            "check that llama-server runs there (npu-spec doctor --upstream URL)",
        ) from None


async def _load_drafter(
    settings: ProxySettings, facts: Any
) -> tuple[Callable[[], Any] | None, LoadedDrafter | None]:
    """(session opener, loaded drafter), loaded in a thread; a drafter for another
    model, an absent provider or an unusable folder is the user's to fix."""
    from npu_draft.providers import ProviderMismatch, ProviderUnavailable
    from npu_draft.tokenizer_check import TokenizerMismatch

    try:
        return await asyncio.to_thread(_drafter_opener, settings, facts)
    except (TokenizerMismatch, ProviderMismatch, ProviderUnavailable, OSError, ValueError) as error:
        raise UserError(f"drafter {settings.drafter}: {error}") from None


async def _listen(settings: ProxySettings, runner: web.AppRunner, base_url: str) -> None:
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("npu-spec proxy on http://%s:%d -> %s", settings.host, settings.port,
             redact_url(base_url))  # fmt: skip
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it may "
                    "use the model", settings.host)  # fmt: skip


def redact_url(url: str) -> str:
    """`url` without a password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
