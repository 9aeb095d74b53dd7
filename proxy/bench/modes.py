"""The ways of serving one generation.

- plain: llama-server alone (one slot, the same context per slot as the others);
- builtin: llama-server with llama.cpp's own drafting (`-md draft.gguf
  --spec-type draft-simple`) at the same k;
- builtin-synth: the same, with llama-server's `--spec-synth-rates` (b11434:
  common/arg.cpp, common/speculative.cpp): the server drafts with the real draft
  model but accepts each draft at random instead of by match, so acceptance is set
  like the oracle's. Benchmarking only: its output is not valid;
- proxy: `npu-spec serve` with the drafter folder;
- oracle: `npu-spec serve` with the oracle drafter (npu_draft.oracle).

plain and builtin get a llama-server each, started fresh and stopped after use.
proxy and oracle at one k share one llama-server started exactly as managed mode
starts it (`proxy.server.managed`); each attaches its own `npu-spec serve --upstream`
process to it, and every slot is erased before each, so no mode inherits another's
cache. Sharing saves a model load per mode, which is most of the start-up time of
a large target. The proxy runs as its own process, as users run it, so its timings
include the real HTTP hops and its memory is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from proxy.bench.procmem import child_pids, gpu_memory_mb, gpu_used_mb, peak_rss_mb
from proxy.server.llama_server import LlamaServerProcess, free_port
from proxy.server.managed import ServerLayout, managed_server

MODE_KINDS = ("plain", "builtin", "builtin-synth", "proxy", "oracle")
BUILTIN_KINDS = ("builtin", "builtin-synth")
SYNTH_LABEL = "benchmarking only: output not valid"
# llama.cpp logs its drafter's cumulative statistics at the end of each request at
# trace verbosity (common_speculative_print_stats): `-lv 4` turns them on
TRACE_VERBOSITY = ["-lv", "4"]
_DRAFT_STATS = re.compile(
    r"statistics\s+(?P<impl>\S+): #calls\(b,g,a\) =\s*\d+\s+(?P<calls>\d+)\s+\d+.*?"
    r"#gen tokens =\s*(?P<tokens>\d+).*?dur\(b,g,a\) = [\d.]+, (?P<ms>[\d.]+), [\d.]+ ms"
)


def synth_rates(a: float, k: int) -> str:
    """`--spec-synth-rates` for i.i.d. acceptance a at k drafts.

    The flag takes exactly n_max values (the draft's --spec-draft-n-max), each the
    UNCONDITIONAL probability that draft position i (0-based) is accepted, non-
    increasing in [0, 1]; the server turns them into conditional rates P_i/P_(i-1).
    i.i.d. a per token is P_i = a^(i+1): a, a^2, ..., a^k."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"synthetic acceptance {a} outside [0, 1]")
    if k < 1:
        raise ValueError("synthetic acceptance needs k >= 1")
    return ",".join(f"{a ** (i + 1):.6g}" for i in range(k))


@dataclass(frozen=True)
class DraftStats:
    """llama.cpp's drafter statistics (cumulative since the server started)."""

    calls: int  # draft() calls
    tokens: int  # draft tokens generated
    ms: float  # time inside draft() (the draft model's k steps; not its re-sync)


def last_draft_stats(log_text: str) -> DraftStats | None:
    """The last `statistics draft-simple: ...` line of a llama-server log."""
    found = None
    for match in _DRAFT_STATS.finditer(log_text):
        found = match
    if found is None:
        return None
    return DraftStats(int(found["calls"]), int(found["tokens"]), float(found["ms"]))


@dataclass(frozen=True)
class ModeSpec:
    kind: str  # one of MODE_KINDS
    k: int = 0
    acceptance: float | None = None  # oracle and builtin-synth
    delay_ms: float = 0.0  # oracle only
    delay_steps: float | None = None  # oracle: delay_ms as a fraction of the plain step
    runner_up_hits: float = 0.0  # oracle: misses after which a draft is ready at once
    variant: str = ""  # proxy and oracle: a named set of extra `npu-spec serve` options
    serve_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        base = self.kind
        if self.kind == "oracle":
            steps = "" if self.delay_steps is None else f"X={self.delay_steps:g},"
            hits = f",ru={self.runner_up_hits:g}" if self.runner_up_hits else ""
            base = f"oracle(a={self.acceptance:g},{steps}{self.delay_ms:.3g}ms{hits})"
        elif self.kind == "builtin-synth":
            base = f"builtin-synth(a={self.acceptance:g})"
        return f"{base}[{self.variant}]" if self.variant else base

    @property
    def valid_output(self) -> bool:
        """False for synthetic acceptance: its output is not the target's."""
        return self.kind != "builtin-synth"

    @property
    def speculative(self) -> bool:
        """Served through the proxy (and its shared verification server)."""
        return self.kind in ("proxy", "oracle")


@dataclass
class ServeConfig:
    """What every mode shares: binaries, models and server settings."""

    llama_server: Path
    target: Path
    draft_gguf: Path | None
    drafter: Path | None
    ctx: int  # per-slot context for every server
    threads: int | None = None
    server_args: list[str] = field(default_factory=list)  # to every llama-server
    builtin_args: list[str] = field(default_factory=list)  # builtin mode only
    provider: str = "auto"
    log_dir: Path = Path(".")
    startup_timeout: float = 600.0


def _child_listening_on(port: int) -> int | None:
    """The pid of this process's child started with `--port PORT`."""
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(port).encode() in cmdline and b"--port" in cmdline:
                return pid
    return None


def _threads(config: ServeConfig) -> list[str]:
    return ["-t", str(config.threads)] if config.threads else []


def _env_with_this_checkout() -> dict[str, str]:
    """The environment, with this checkout importable (also when not installed)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class ModeInstance:
    """A running mode: where to send requests and which processes to measure."""

    base_url: str
    metrics_url: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def pids(self) -> dict[str, int]:
        return {}

    def memory(self) -> dict[str, float | None]:
        """Peak RSS (MiB) per process, and GPU memory in use now (MiB) per process."""
        pids = self.pids()
        out: dict[str, float | None] = {f"rss_mb.{n}": peak_rss_mb(p) for n, p in pids.items()}
        gpu = gpu_memory_mb()
        if gpu is not None:
            for name, pid in pids.items():
                out[f"gpu_mb.{name}"] = gpu.get(pid, 0.0)
            out["gpu_mb.device_used"] = gpu_used_mb()  # only this mode runs on the GPU
        return out


class LlamaServerMode(ModeInstance):
    """plain, builtin and builtin-synth: a llama-server of their own."""

    def __init__(self, config: ServeConfig, spec: ModeSpec, log_name: str) -> None:
        args = ["-c", str(config.ctx), "-np", "1", "--metrics", *_threads(config)]
        args += config.server_args
        if spec.kind in BUILTIN_KINDS:
            if config.draft_gguf is None:
                raise ValueError("builtin modes need --draft-gguf")
            args += [
                "-md", str(config.draft_gguf),
                "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(spec.k),
                "--spec-draft-n-min", "0",
                *(["-td", str(config.threads)] if config.threads else []),
                *TRACE_VERBOSITY,
                *config.builtin_args,
            ]  # fmt: skip
        if spec.kind == "builtin-synth":
            assert spec.acceptance is not None
            args += ["--spec-synth-rates", synth_rates(spec.acceptance, spec.k)]
        self.server = LlamaServerProcess(
            config.llama_server, config.target, args, log_path=config.log_dir / f"{log_name}.log"
        )
        self.timeout = config.startup_timeout
        self._log_start = 0

    async def start(self) -> None:
        path = self.server.log_path
        # the log is appended to: this server's statistics start here
        self._log_start = path.stat().st_size if path is not None and path.exists() else 0
        await self.server.start(self.timeout)
        self.base_url = self.server.base_url
        self.metrics_url = self.base_url + "/metrics"

    async def stop(self) -> None:
        await self.server.stop()

    async def draft_stats(self, after: DraftStats | None = None) -> DraftStats | None:
        """The drafter's statistics once the log shows a request newer than `after`
        (the server logs them when a request ends, from its logging thread)."""
        path = self.server.log_path
        stats = None
        for _ in range(100):
            if path is not None and path.exists():
                with open(path, "rb") as log_file:
                    log_file.seek(self._log_start)
                    stats = last_draft_stats(log_file.read().decode(errors="replace"))
                if stats is not None and (after is None or stats.calls > after.calls):
                    return stats
            await asyncio.sleep(0.02)
        return stats

    def pids(self) -> dict[str, int]:
        pid = _child_listening_on(self.server.port)
        return {"llama-server": pid} if pid is not None else {}


class VerifyServer:
    """The llama-server that proxy and oracle modes at one k attach to, started with
    exactly the flags `npu-spec serve --target` uses (one conversation)."""

    def __init__(self, config: ServeConfig, k: int, log_name: str) -> None:
        self.layout = ServerLayout(k, config.ctx)
        self.server = managed_server(
            config.target,
            self.layout,
            binary=config.llama_server,
            threads=config.threads,
            slot_save_dir=config.log_dir.parent / "slots",
            extra_args=config.server_args,
            log_path=config.log_dir / f"{log_name}.log",
        )
        self.timeout = config.startup_timeout

    @property
    def base_url(self) -> str:
        return self.server.base_url

    async def start(self) -> None:
        await self.server.start(self.timeout)

    async def stop(self) -> None:
        await self.server.stop()

    async def erase_slots(self, session: aiohttp.ClientSession) -> None:
        """Empty every slot's cache, so the next mode starts as cold as the first."""
        for slot in range(self.layout.slots):
            url = f"{self.base_url}/slots/{slot}?action=erase"
            async with session.post(url) as response:
                if response.status != 200:
                    raise RuntimeError(f"erasing slot {slot}: {response.status}")

    @property
    def pid(self) -> int | None:
        return _child_listening_on(self.server.port)


class ProxyMode(ModeInstance):
    """proxy and oracle: `npu-spec serve --upstream` attached to a VerifyServer."""

    def __init__(
        self, config: ServeConfig, spec: ModeSpec, drafter: Path, log_name: str,
        verify_server: VerifyServer,
    ) -> None:  # fmt: skip
        self.verify_server = verify_server
        self.port = free_port()
        # `npu-spec serve` as users run it; npu_draft.load routes oracle.json folders.
        self.command = [
            sys.executable, "-m", "proxy.cli", "serve",
            "--upstream", verify_server.base_url,
            "--drafter", str(drafter),
            "--provider", config.provider,
            "-k", str(spec.k),
            "--port", str(self.port),
            *spec.serve_args,
        ]  # fmt: skip
        self.log_path = config.log_dir / f"{log_name}.proxy.log"
        self.timeout = config.startup_timeout
        self.process: asyncio.subprocess.Process | None = None
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = self.base_url + "/metrics"

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as sink:
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdout=sink, stderr=sink, stdin=asyncio.subprocess.DEVNULL,
                env=_env_with_this_checkout(),
            )  # fmt: skip
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if self.process is None or self.process.returncode is not None:
                    raise RuntimeError(f"proxy exited during start-up; {self._log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.base_url + "/health") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"proxy not ready within {self.timeout:.0f} s; {self._log_tail()}")

    def _log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-20:]
        return f"command: {' '.join(self.command)}\nlog {self.log_path}:\n" + "\n".join(lines)

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()

    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        server_pid = self.verify_server.pid
        if server_pid is not None:
            out["llama-server"] = server_pid
        if self.process is not None:
            out["proxy"] = self.process.pid
        return out


def make_instance(
    config: ServeConfig, spec: ModeSpec, log_name: str,
    verify_server: VerifyServer | None = None, oracle_folder: Path | None = None,
) -> ModeInstance:  # fmt: skip
    if spec.kind in ("plain", *BUILTIN_KINDS):
        return LlamaServerMode(config, spec, log_name)
    if spec.kind not in MODE_KINDS:
        raise ValueError(f"unknown mode {spec.kind!r}; one of {', '.join(MODE_KINDS)}")
    assert verify_server is not None
    if spec.kind == "proxy":
        if config.drafter is None:
            raise ValueError("proxy mode needs --drafter")
        return ProxyMode(config, spec, config.drafter, log_name, verify_server)
    assert oracle_folder is not None
    return ProxyMode(config, spec, oracle_folder, log_name, verify_server)
