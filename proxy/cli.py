"""`npu-spec` command line: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`;
they are imported lazily so `npu-spec --help` stays fast and a heavy import in one
subcommand never slows another.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from proxy.user_errors import UserError

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("proxy.serve_cmd", "run the speculative proxy in front of llama-server"),
    "install-server": (
        "proxy.server.server_install",
        "build the pinned stock llama-server into the user cache",
    ),
    "make-models": ("npu_draft.factory.cli", "write offline test/demo models (GGUF, HF, drafter)"),
    "export-drafter": (
        "npu_draft.export",
        "turn a Hugging Face Qwen3 checkpoint into a drafter folder",
    ),
    "doctor": ("proxy.doctor", "report llama-server, ONNX Runtime providers and server setup"),
    "bench": ("proxy.bench_cmd", "plain vs llama.cpp drafting vs the proxy vs an oracle drafter"),
    "verify-cost": (
        "proxy.bench.verify_cost",
        "what one verify round costs on llama-server, and why",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npu-spec",
        description="Lossless speculative decoding in front of a stock llama-server.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((arg for arg in sys.argv[1:] if arg in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module whose arguments are needed
            _module(module_name).add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module_name)
    return parser


def _module(name: str):
    return importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(_module(args._module).run(args) or 0)
    except UserError as error:  # a mistake the user can fix: one line, no traceback
        print(f"npu-spec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
