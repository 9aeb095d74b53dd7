"""`python -m proxy.bench.regime --regime NAME [llama-server options]`: the regime server.

It takes llama-server's own command line (the options it emulates are read, the rest
such as -ngl or -fa are accepted and ignored), so anything that starts llama-server
can start it instead: `--write-launcher PATH` writes an executable that does, for
`npu-spec serve --llama-server PATH` or `npu-spec bench --llama-server PATH`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from aiohttp import web

from proxy.bench.regime.engine import RegimeEngine
from proxy.bench.regime.http_api import BUILD, RegimeApi, ServerOptions
from proxy.bench.regime.regime_file import load_regime, regime_path
from proxy.bench.regime.target import ScriptedTarget

log = logging.getLogger("regime-server")


def write_launcher(regime: str | Path, path: Path) -> Path:
    """An executable that runs this server with `regime` and whatever options it gets."""
    resolved = regime_path(regime).resolve()
    repo = Path(__file__).resolve().parents[3]
    path.write_text(
        "#!/bin/sh\n"
        f"export PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"exec {shlex.quote(sys.executable)} -m proxy.bench.regime "
        f'--regime {shlex.quote(str(resolved))} "$@"\n'
    )
    path.chmod(0o755)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="regime-server", description=__doc__, allow_abbrev=False)
    p.add_argument("--regime", default=os.environ.get("NPU_SPEC_REGIME"), help="name or .toml")
    p.add_argument("--write-launcher", type=Path, help="write a launcher script and exit")
    p.add_argument("--version", action="store_true")
    p.add_argument("-m", "--model", default="regime.gguf")
    p.add_argument("-a", "--alias")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-kvu", "--kv-unified", action="store_true")
    p.add_argument("--kv-unified-per-slot", type=int, help="each slot's context limit under -kvu")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--slot-save-path", type=Path)
    p.add_argument("-cram", "--cache-ram", type=int, default=8192, help="MiB; 0: no prompt cache")
    p.add_argument("--api-key")
    p.add_argument("--api-key-file", type=Path)
    p.add_argument("--target-seed", type=int, default=0, help="the scripted target's seed")
    return p


FLAGS = {"--version", "-kvu", "--kv-unified", "--metrics", "-h", "--help"}


def split_known(argv: list[str], p: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """llama-server's command line into the options this server reads and the rest
    (argparse alone would read '-cram 0' as '-c ram', '-md X' as '-m d')."""
    known_options = {o for action in p._actions for o in action.option_strings}
    known: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        takes_value = name not in FLAGS and "=" not in arg
        has_value = takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if has_value and argv[i + 1].startswith("-") and not argv[i + 1][1:].isdigit():
            has_value = False  # the next option, not a value
        group = argv[i : i + 1 + int(has_value)]
        (known if name in known_options else ignored).extend(group)
        i += len(group)
    return known, ignored


def main(argv: list[str] | None = None) -> int:
    p = parser()
    known, ignored = split_known(list(sys.argv[1:] if argv is None else argv), p)
    args = p.parse_args(known)
    if args.version:
        print(f"version: 11434 ({BUILD}, regime server)", file=sys.stderr)
        return 0
    if not args.regime:
        print("regime-server: give --regime NAME or a .toml path", file=sys.stderr)
        return 2
    if args.write_launcher:
        print(write_launcher(args.regime, args.write_launcher))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s regime-server: %(message)s")
    regime = load_regime(args.regime)
    from npu_draft.factory.make import _pinned_sources, _tokenizer_dir

    target = ScriptedTarget(_tokenizer_dir(*_pinned_sources()), seed=args.target_seed)
    n_ctx = -(-args.ctx_size // 256) * 256  # the context pads up to 256 cells
    api_key = args.api_key
    if args.api_key_file:
        api_key = args.api_key_file.read_text().split()[0]
    options = ServerOptions(
        model_path=args.model,
        n_slots=args.parallel,
        n_ctx=n_ctx,
        unified=args.kv_unified,
        metrics=args.metrics,
        slot_save_path=args.slot_save_path,
        api_key=api_key,
        alias=args.alias,
    )
    engine = RegimeEngine(
        regime, target, args.parallel, n_ctx, args.kv_unified,
        n_batch=min(args.batch_size, args.ctx_size), n_ctx_slot=args.kv_unified_per_slot,
        prompt_cache=args.cache_ram != 0,
    )  # fmt: skip
    log.info(
        "regime %s (%s): -np %d -c %d%s; ignored options: %s", regime.name, regime.path,
        args.parallel, args.ctx_size, " -kvu" if args.kv_unified else "",
        " ".join(ignored) or "none",
    )  # fmt: skip
    app = RegimeApi(regime, target, engine, options).app()
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
