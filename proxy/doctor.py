"""`npu-spec doctor`: say plainly what this machine (and an upstream server) can do."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import shlex
import struct
from collections.abc import Callable
from pathlib import Path

from proxy.user_errors import UserError

# The checks import what they need when they run: `doctor --plan` reads one GGUF
# header and should not wait for pydantic or an HTTP client to load.

NPU_PROVIDER = "VitisAIExecutionProvider"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_server_report(explicit: str | None) -> tuple[list[str], bool]:
    from proxy.server.llama_server import LlamaServerNotFound, find_llama_server, server_version

    try:
        binary = find_llama_server(explicit)
    except LlamaServerNotFound as error:
        return [f"llama-server: MISSING - {error}"], False
    return [f"llama-server: {binary}", f"  {server_version(binary)}"], True


def onnxruntime_report() -> list[str]:
    lines = []
    try:
        import onnxruntime
    except ImportError as error:
        return [f"onnxruntime: NOT IMPORTABLE ({error})"]
    providers = onnxruntime.get_available_providers()
    ort_dist = next(
        (
            f"{name} {_version(name)}"
            for name in ("onnxruntime-vitisai", "onnxruntime-gpu", "onnxruntime")
            if _version(name)
        ),
        f"onnxruntime {onnxruntime.__version__}",
    )
    lines.append(f"onnxruntime: {ort_dist}")
    lines.append(f"  execution providers: {', '.join(providers)}")
    if NPU_PROVIDER in providers:
        lines.append(f"  NPU: yes ({NPU_PROVIDER} is available)")
    else:
        lines.append(
            f"  NPU: no ({NPU_PROVIDER} is not in this onnxruntime build; drafters run on "
            + (
                "CUDA (fp16 drafters; fp32 ones on the CPU)"
                if "CUDAExecutionProvider" in providers
                else "the CPU"
            )
            + ")"
        )
    genai = _version("onnxruntime-genai") or _version("onnxruntime-genai-cuda")
    lines.append(
        f"onnxruntime-genai: {genai or 'not installed (genai folders run on the onnx backend)'}"
    )
    return lines


def upstream_report(url: str, k: int, conversations: int) -> tuple[list[str], bool]:
    from proxy.config import normalize_upstream_url
    from proxy.server.attach_check import check_upstream, restart_command

    try:
        url = normalize_upstream_url(url)
    except ValueError as error:
        return [f"upstream {url}: FAIL - {error}"], False
    try:
        findings = asyncio.run(check_upstream(url, k=k, conversations=conversations))
    except Exception as error:  # an unreachable server is a finding, not a crash
        return [f"upstream {url}: UNREACHABLE - {error}"], False
    lines = [f"upstream {url} (k={k}, {conversations} conversation(s)):"]
    healthy = True
    for finding in findings:
        mark = {"ok": "ok", "warning": "WARN", "error": "FAIL"}[finding.severity]
        fix = f" -> fix: {finding.fix}" if getattr(finding, "fix", None) else ""
        lines.append(f"  [{mark}] {finding.message}{fix}")
        healthy &= finding.severity != "error"
    fixable = [f for f in findings if f.severity != "ok" and f.fix and f.fix.startswith("-")]
    if fixable:
        try:
            command = asyncio.run(restart_command(url, k=k, conversations=conversations))
        except Exception as error:  # the findings above still stand
            lines.append(f"  (no restart command: {error})")
        else:
            lines.append(
                f"  restart llama-server with every flag it needs ({command.ctx} tokens per "
                "conversation, its context per slot now):"
            )
            lines.append("    " + shlex.join(command.argv))
            slot_dir = Path(command.argv[command.argv.index("--slot-save-path") + 1])
            if not slot_dir.is_dir():  # llama-server refuses a missing folder
                lines.append(
                    f"  (create its slot folder first: mkdir -p {shlex.quote(str(slot_dir))})"
                )
            if not command.own_flags_known:
                lines.append("  (its command line is not visible from here: add your own flags)")
    return lines, healthy


def plan_report(args: argparse.Namespace) -> list[str]:
    from proxy.server.kv_plan import KvPlan, plan_lines, read_kv_shape
    from proxy.server.managed import ServerLayout

    if args.model is None:
        raise UserError("--plan needs the target model", "add --model MODEL.gguf")
    model = Path(args.model).expanduser()
    if not model.is_file():
        raise UserError(f"model {model} does not exist", "give --model the path of a .gguf file")
    try:
        shape = read_kv_shape(model)
    except (ValueError, KeyError, TypeError, struct.error) as error:
        raise UserError(f"{model} does not read as a GGUF model ({error})") from None
    layout = ServerLayout(args.k, args.ctx, args.conversations, args.passthrough_slots)
    try:
        plan = KvPlan(layout, shape, args.cache_type_k, args.cache_type_v)
        return plan_lines(plan, model, Path(args.slot_save_path))
    except ValueError as error:
        raise UserError(str(error), "use a llama.cpp cache type such as f16 or q8_0") from None


def rpc_report(url: str) -> list[str]:
    """Whether the upstream splits its model over llama.cpp RPC devices. Its HTTP API
    names no devices, so this reads the --rpc argument of the process listening on the
    upstream's port, which is visible only when it runs on this host as this user. An
    RPC split is a supported set-up, reported as ok, never as a misconfiguration."""
    from proxy.server.rpc import local_rpc_use

    use = local_rpc_use(url)
    if use is None:
        return []
    return [
        f"  [ok] model split over {len(use.endpoints)} RPC server(s) "
        f"{', '.join(use.endpoints)} (llama-server pid {use.pid}, --rpc): every decode "
        "step crosses the network, so each verify round saves round trips"
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llama-server", default=None, metavar="PATH", help="llama-server binary to check"
    )
    parser.add_argument(
        "--upstream",
        default=None,
        metavar="URL",
        help="URL of a running llama-server to check for verification (http:// is assumed "
        "without a scheme)",
    )
    parser.add_argument(
        "-k", type=int, default=4, help="draft length to check slots for (default: %(default)s)"
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=1,
        metavar="N",
        help="concurrent conversations to plan slots for (default: %(default)s)",
    )
    plan = parser.add_argument_group(
        "--plan", "print the llama-server flags for a model, k and context, and the KV memory"
    )
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the llama-server command line and its KV cache size, then exit",
    )
    plan.add_argument("--model", metavar="GGUF", help="--plan: the target model")
    plan.add_argument(
        "--ctx",
        type=int,
        default=4096,
        metavar="TOKENS",
        help="--plan: context per conversation (default: %(default)s)",
    )
    plan.add_argument(
        "--passthrough-slots",
        type=int,
        default=1,
        metavar="N",
        help="--plan: extra slots for passed-through requests (default: %(default)s)",
    )
    plan.add_argument(
        "--cache-type-k",
        default="f16",
        metavar="TYPE",
        help="--plan: llama-server's -ctk (default: %(default)s)",
    )
    plan.add_argument(
        "--cache-type-v",
        default="f16",
        metavar="TYPE",
        help="--plan: llama-server's -ctv (default: %(default)s)",
    )
    plan.add_argument(
        "--slot-save-path",
        default="/tmp/npu-spec-slots",
        metavar="DIR",
        help="--plan: the folder for --slot-save-path in the printed flags (default: %(default)s)",
    )


def run(args: argparse.Namespace, echo: Callable[[str], None] = print) -> int:
    if getattr(args, "plan", False):
        for line in plan_report(args):
            echo(line)
        return 0
    ok = True
    lines, found = llama_server_report(args.llama_server)
    ok &= found or args.upstream is not None  # attached mode needs no local binary
    lines += onnxruntime_report()
    if args.upstream:
        upstream_lines, healthy = upstream_report(args.upstream, args.k, args.conversations)
        lines += upstream_lines + rpc_report(args.upstream)
        ok &= healthy
    for line in lines:
        echo(line)
    return 0 if ok else 1
