"""`npu-spec serve`: the speculative proxy, managed (--target) or attached (--upstream)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web
from pydantic import ValidationError

from proxy.config import ProxySettings, load_settings

log = logging.getLogger(__name__)

# option -> settings field; every option defaults to "not given" so the environment
# and the config file can supply it.
_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--target",), {"help": "GGUF model: start llama-server with the right flags"}),
    (("--upstream",), {"help": "URL of a running llama-server to attach to"}),
    (("--drafter",), {"help": "drafter folder, 'ngram[:sizes]' or 'FOLDER+ngram'"}),
    (("--provider",), {"help": "drafter execution provider: auto, npu, cuda, cpu"}),
    (("--drafter-threads",), {"type": int, "dest": "drafter_threads"}),
    (("-k",), {"type": int, "dest": "k", "help": "most draft tokens per round"}),
    (
        ("--fixed-k",),
        {
            "action": "store_false",
            "dest": "adaptive_k",
            "default": None,
            "help": "always draft k tokens (default: choose per round, up to k)",
        },
    ),
    (
        ("--draft-length",),
        {
            "choices": ["formula", "uniform", "marginal"],
            "dest": "draft_length",
            "help": "adaptive draft length: formula (default; the lengths with the most "
            "expected tokens per expected round time, from measured acceptance, drafting "
            "speed and per-length verify costs, counting only drafting not hidden by drafting "
            "ahead: one for rounds whose drafts were drafted ahead, a shorter one for rounds "
            "that draft fresh), uniform (one such length) or marginal (position by position "
            "from the draft's own confidence)",
        },
    ),
    (
        ("--overlap",),
        {
            "choices": ["auto", "on", "off"],
            "dest": "overlap",
            "help": "draft while the server verifies: auto (default; measured, kept where it "
            "pays), on, off",
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
            "help": "on (default): start the next round's draft as soon as a verify result "
            "is back, while the proxy commits the round's tokens; off: when the next round "
            "starts",
        },
    ),
    (
        ("--predraft",),
        {
            "choices": ["on", "off"],
            "dest": "predraft",
            "help": "on: while the server verifies, also draft after the draft's likeliest "
            "runner-up, so a round whose correction (or bonus) is that token starts with its "
            "draft ready; off (default)",
        },
    ),
    (
        ("--branch-prompts",),
        {
            "type": int,
            "dest": "branch_prompts",
            "help": "most extra prompts per round that verify a second continuation starting "
            "at the draft's runner-up, used where the measured costs say it pays (default 0: "
            "off); they share the round's k+1 slots",
        },
    ),
    (
        ("--plain-runs",),
        {
            "choices": ["auto", "off"],
            "dest": "plain_runs",
            "help": "auto (default): while speculating costs more per token than letting "
            "llama-server decode alone (both measured), requests go on in plain runs (seeded "
            "sampling requests always speculate); off: always speculate",
        },
    ),
    (("--host",), {"help": "address to listen on (default 127.0.0.1)"}),
    (("--port",), {"type": int, "help": "port to listen on (default 8080)"}),
    (("--llama-server",), {"dest": "llama_server", "help": "llama-server binary"}),
    (("--ctx",), {"type": int, "help": "context per conversation in tokens (managed)"}),
    (("--conversations",), {"type": int, "help": "concurrent speculative conversations"}),
    (("--passthrough-slots",), {"type": int, "dest": "passthrough_slots"}),
    (("--threads",), {"type": int, "help": "llama-server -t (managed)"}),
    (("--server-port",), {"type": int, "dest": "server_port"}),
    (("--server-log",), {"dest": "server_log", "help": "file for llama-server's log"}),
    (
        ("--server-arg",),
        {"action": "append", "dest": "server_args", "help": "extra llama-server argument"},
    ),
    (("--when-busy",), {"choices": ["queue", "passthrough"], "dest": "when_busy"}),
    (("--check-decodes",), {"action": "store_true", "dest": "check_decodes", "default": None}),
    (
        ("--attach-policy",),
        {"choices": ["refuse", "degrade"], "dest": "attach_policy"},
    ),
    # Keys on the command line are visible to other local users (ps): prefer
    # NPU_SPEC_API_KEY / NPU_SPEC_UPSTREAM_API_KEY or the config file.
    (("--api-key",), {"dest": "api_key", "help": "require Authorization: Bearer KEY"}),
    (("--upstream-api-key",), {"dest": "upstream_api_key", "help": "key for llama-server"}),
    (("--max-body-bytes",), {"type": int, "dest": "max_body_bytes"}),
    (("--max-queue",), {"type": int, "dest": "max_queue", "help": "then 503 + Retry-After"}),
    (
        ("--no-slot-actions",),
        {"action": "store_false", "dest": "allow_slot_actions", "default": None},
    ),
    (("--draft-timeout",), {"type": float, "dest": "draft_timeout_s"}),
    (("--verify-timeout",), {"type": float, "dest": "verify_timeout_s"}),
    (
        ("--no-restart-server",),
        {"action": "store_false", "dest": "restart_server", "default": None},
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML or JSON file with the same option names")
    for flags, options in _OPTIONS:
        options = {"default": None, **options}
        parser.add_argument(*flags, **options)


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    fields = ProxySettings.model_fields
    given = {
        name: value for name, value in vars(args).items() if name in fields and value is not None
    }
    return load_settings(given, getattr(args, "config", None))


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        log.error("invalid settings: %s", exc)
        return 2
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 0


async def target_tokenizer_facts(upstream: Any) -> Any:
    """The target's tokenizer facts, read from the running server (DESIGN.md §5):
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


def _drafter_reloader(settings: ProxySettings, target: Any) -> Callable[[], Callable[[], Any]]:
    """After a drafter failure: load the model again (a crashed NPU session may leave
    the old one unusable) and hand back a fresh session opener. Runs in a thread."""

    def reload() -> Callable[[], Any]:
        opener, _model = _drafter_opener(settings, target)
        assert opener is not None
        return opener

    return reload


def _drafter_opener(
    settings: ProxySettings, target: Any = None
) -> tuple[Callable[[], Any] | None, Any]:
    """(open a session adapter, the loaded model) for the configured drafter; with
    `target` facts, a drafter built for another tokenizer is refused."""
    if not settings.drafter:
        return None, None
    from npu_draft.load import load_drafter
    from proxy.engine import AsyncSessionDrafter

    options = {"threads": settings.drafter_threads} if settings.drafter_threads else {}
    model = load_drafter(settings.drafter, settings.provider, target=target, **options)
    log.info(
        "drafter %s: backend %s on %s", model.info.name, model.info.backend, model.info.provider
    )

    def open_session() -> AsyncSessionDrafter:
        return AsyncSessionDrafter(model.open_session())

    return open_session, model


async def serve(settings: ProxySettings, ready: asyncio.Event | None = None) -> int:
    from proxy.api import build_state, create_app
    from proxy.attach_check import check_upstream
    from proxy.managed import ServerLayout, ServerSupervisor, managed_server, write_key_file
    from proxy.upstream import Timeouts, UpstreamClient

    server = None
    supervisor = None
    model = None
    runner: web.AppRunner | None = None
    upstream: UpstreamClient | None = None
    errors: list = []
    temp_slots: Path | None = None
    key_dir: Path | None = None
    upstream_key = settings.upstream_api_key
    try:
        if settings.target is not None:
            slot_dir = settings.slot_save_dir
            if slot_dir is None:  # slot files are ours alone: removed on exit
                temp_slots = slot_dir = Path(tempfile.mkdtemp(prefix="npu-spec-slots-"))
            server_args = list(settings.server_args)
            if upstream_key is None and settings.api_key:
                # a key on the proxy means nobody should reach the managed server
                # around it: give the server a random key only the proxy knows
                upstream_key = secrets.token_urlsafe(24)
            if upstream_key is not None:
                key_dir = Path(tempfile.mkdtemp(prefix="npu-spec-key-"))
                server_args += ["--api-key-file", str(write_key_file(upstream_key, key_dir))]
            layout = ServerLayout(
                settings.k, settings.ctx, settings.conversations, settings.passthrough_slots
            )
            server = managed_server(
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
            base_url = server.base_url
            log.info("managed llama-server at %s (%d slots)", base_url, layout.slots)
            if settings.restart_server:
                supervisor = ServerSupervisor(server, settings.max_restarts)
                supervisor.start()
        else:
            assert settings.upstream is not None
            base_url = settings.upstream
        # Attached without an upstream key, clients' Authorization headers are
        # forwarded as they came; the proxy's own calls then carry its own key, which
        # is what those clients had to present.
        own_key = upstream_key if upstream_key is not None else settings.api_key
        if settings.target is None:
            findings = await check_upstream(
                base_url, settings.k, settings.conversations, api_key=own_key
            )
            errors = [f for f in findings if f.severity == "error"]
            for finding in findings:
                level = logging.ERROR if finding.severity == "error" else logging.INFO
                fix = f" (fix: {finding.fix})" if finding.fix else ""
                log.log(level, "%s: %s%s", finding.severity, finding.message, fix)
            if errors and settings.attach_policy == "refuse":
                log.error(
                    "refusing to serve speculatively; fix the flags above or pass "
                    "--attach-policy degrade to pass everything through"
                )
                return 1
        upstream = UpstreamClient(
            base_url, Timeouts(verify=settings.verify_timeout_s), api_key=own_key
        )
        facts = await target_tokenizer_facts(upstream)
        open_drafter, model = await asyncio.to_thread(_drafter_opener, settings, facts)
        if errors:  # attached with --attach-policy degrade
            open_drafter = None  # every request goes through unchanged
        state = await build_state(
            upstream,
            settings.k,
            open_drafter,
            adaptive_k=settings.adaptive_k,
            draft_length=settings.draft_length,
            early_draft=settings.early_draft,
            overlap=settings.overlap,
            plain_runs=settings.plain_runs,
            predraft=settings.predraft,
            branch_prompts=settings.branch_prompts,
            check_decodes=settings.check_decodes,
            strict_decodes=settings.strict_decodes,
            when_busy=settings.when_busy,
            queue_timeout_s=settings.queue_timeout_s,
            max_queue=settings.max_queue,
            api_key=settings.api_key,
            max_body_bytes=settings.max_body_bytes,
            allow_slot_actions=settings.allow_slot_actions,
            draft_timeout_s=settings.draft_timeout_s,
            reload_drafter=_drafter_reloader(settings, facts) if open_drafter else None,
            retry_after_s=settings.retry_after_s,
            passthrough_read_timeout_s=settings.passthrough_read_timeout_s,
            replace_upstream_auth=upstream_key is not None,
            server_restarts=(lambda: supervisor.restarts) if supervisor is not None else None,
        )
        runner = web.AppRunner(create_app(state), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        log.info("npu-spec proxy on http://%s:%d -> %s", settings.host, settings.port,
                 redact_url(base_url))  # fmt: skip
        if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
            log.warning("listening on %s without --api-key: anyone who can reach it may "
                        "use the model", settings.host)  # fmt: skip
        if ready is not None:
            ready.set()
        await _wait_for_signal()
        return 0
    finally:
        if supervisor is not None:
            await supervisor.stop()
        if runner is not None:
            await runner.cleanup()
        if upstream is not None:
            await upstream.close()
        if model is not None:
            with contextlib.suppress(Exception):
                model.close()
        if server is not None:
            await server.stop()
        if temp_slots is not None:
            shutil.rmtree(temp_slots, ignore_errors=True)
        if key_dir is not None:
            shutil.rmtree(key_dir, ignore_errors=True)


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
