"""Run a command while N ggml-rpc-servers are up on loopback, optionally behind a
relay that adds a fixed one-way delay (a stand-in for the network between hosts).

    python scripts/rpc_stack.py --servers 2 --delay-ms 1 -- \\
      npu-spec verify-cost --models DIR --variant 'rpc=--rpc {rpc} -ngl 99'

`{rpc}` in the command becomes the comma list of endpoints llama-server should use
(also in $NPU_SPEC_RPC). The delay is added in user space: `tc qdisc ... netem` needs
the kernel's sch_netem, which this sandbox's kernel does not have. The relay holds
every chunk it reads for `--delay-ms` before writing it on, in each direction and in
order, so a request-response exchange gains twice the delay (what a link with that
one-way latency adds; bandwidth is not limited). What it really added is measured and
printed when the command ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from proxy.server.llama_server import free_port
from proxy.server.rpc import RpcServerNotFound, find_rpc_server, rpc_servers

log = logging.getLogger(__name__)


class DelayRelay:
    """A TCP relay from host:port to a target that delays each chunk by `delay_s`."""

    def __init__(
        self, target_host: str, target_port: int, delay_s: float, host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.host = host
        self.port = free_port(host)
        self.lateness_s: list[float] = []  # actual hold minus delay_s, per chunk
        # Replies: data from the server after data from the client on one connection,
        # i.e. the round trips a client had to wait for (whatever the delay).
        self.replies = 0
        self.bytes = {"up": 0, "down": 0}  # to the server, back from it
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            last = ["down"]  # which way the latest chunk went, shared by both pipes
            await asyncio.gather(
                self._pipe(reader, up_writer, "up", last),
                self._pipe(up_reader, writer, "down", last),
            )
        except OSError as error:
            log.debug("relay connection ended: %s", error)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        direction: str,
        last: list[str],
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.lateness_s.append(loop.time() - due)
                dst.write(data)
                await dst.drain()
            with contextlib.suppress(OSError):
                dst.write_eof()

        sender = asyncio.create_task(send())
        try:
            while data := await src.read(1 << 20):
                if direction == "down" and last[0] == "up":
                    self.replies += 1
                last[0] = direction
                self.bytes[direction] += len(data)
                queue.put_nowait((loop.time() + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            await sender


@contextlib.asynccontextmanager
async def rpc_endpoints(
    binary: Path,
    count: int,
    delay_ms: float,
    threads: int | None,
    log_dir: Path | None,
    relay: bool | None = None,
) -> AsyncIterator[tuple[list[str], list[DelayRelay]]]:
    """`count` rpc-servers, each behind a relay when `relay` (default: when `delay_ms`
    > 0); the endpoints llama-server should use, and the relays."""
    async with rpc_servers(count, binary, threads=threads, log_dir=log_dir) as servers:
        if not (delay_ms > 0 if relay is None else relay):
            yield [s.endpoint for s in servers], []
            return
        relays = [DelayRelay(s.host, s.port, delay_ms / 1000) for s in servers]
        try:
            for relay in relays:
                await relay.start()
            yield [r.endpoint for r in relays], relays
        finally:
            for relay in relays:
                await relay.stop()


async def run_with_stack(args: argparse.Namespace, binary: Path, command: Sequence[str]) -> int:
    stack = rpc_endpoints(binary, args.servers, args.delay_ms, args.threads, args.log_dir)
    async with stack as (endpoints, relays):
        joined = ",".join(endpoints)
        argv = [part.replace("{rpc}", joined) for part in command]
        print(f"rpc endpoints: {joined} (delay {args.delay_ms} ms each way)", file=sys.stderr)
        process = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, "NPU_SPEC_RPC": joined}
        )
        code = await process.wait()
        lateness = [x for relay in relays for x in relay.lateness_s]
        if lateness:
            ms = sorted(x * 1000 for x in lateness)
            print(
                f"relay: {len(ms)} chunks held {args.delay_ms} ms + median "
                f"{statistics.median(ms):.3f} ms (p90 {ms[int(0.9 * (len(ms) - 1))]:.3f} ms) "
                "of scheduling lateness",
                file=sys.stderr,
            )
        return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2, help="ggml-rpc-servers to start")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per hop")
    parser.add_argument("-t", "--threads", type=int, default=1, help="ggml-rpc-server -t")
    parser.add_argument("--log-dir", type=Path, default=None, help="rpc-server logs")
    parser.add_argument(
        "--rpc-server", default=None, help="ggml-rpc-server binary (default: as found)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ({rpc}: endpoints)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        binary = find_rpc_server(args.rpc_server)
    except RpcServerNotFound as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_with_stack(args, binary, command))


if __name__ == "__main__":
    sys.exit(main())
