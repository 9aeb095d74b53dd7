"""The regime server against a real llama-server: the same requests, the same slots.

Both servers get the same command line (the proxy's verification flags) and the same
sequence of requests: a plain run, a slot copy, two verify rounds, a second turn, a
batch of more prompts than slots, an erase; and, with the RAM prompt cache on, two
users taking turns on one slot. Each later prompt is built from that
server's own output, so only the generated token ids differ (the regime server's target
is scripted, not the model); which slot serves each prompt, how many prompt tokens it
ingests and reuses, how many tokens come back and how many decodes each request takes
must be equal.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.regime.__main__ import write_launcher
from proxy.server.llama_server import LlamaServerProcess
from proxy.server.upstream import parse_prometheus

SLOTS = 4
FLAGS = [
    "-np", str(SLOTS), "-c", str(SLOTS * 1024), "-kvu", "--no-cache-idle-slots", "-cram", "0",
    "--metrics", "-t", "2",
]  # fmt: skip
FIELDS = ["index", "tokens", "id_slot", "timings/prompt_n", "timings/cache_n"]
PROMPT = "The lighthouse keeper counted the ships that passed each night and wrote"


class Session:
    """One server's answers, reduced to what must agree."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http = http
        self.base_url = base_url
        self.log: list[Any] = []

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        async with self.http.post(self.base_url + path, json=body) as response:
            payload = await response.json(content_type=None)
            assert response.status == 200, payload
            return payload

    async def decodes(self) -> float:
        async with self.http.get(self.base_url + "/metrics") as response:
            return parse_prometheus(await response.text())["llamacpp:n_decode_total"]

    async def completion(self, prompt: Any, n_predict: int) -> list[dict[str, Any]]:
        before = await self.decodes()
        body = {
            "prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
            "samplers": ["top_k"], "cache_prompt": True, "return_tokens": True,
            "ignore_eos": True, "response_fields": FIELDS,
        }  # fmt: skip
        payload = await self.post("/completion", body)
        results = payload if isinstance(payload, list) else [payload]
        decodes = await self.decodes() - before
        self.log.append(
            (
                [
                    (r.get("index", 0), r["id_slot"], r["timings/prompt_n"],
                     r["timings/cache_n"], len(r["tokens"]))
                    for r in results
                ],
                decodes,
            )
        )  # fmt: skip
        return sorted(results, key=lambda r: r.get("index", 0))

    async def slot(self, id_slot: int, action: str, filename: str = "") -> None:
        payload = await self.post(f"/slots/{id_slot}?action={action}", {"filename": filename})
        self.log.append((action, id_slot, payload.get("n_saved", payload.get("n_restored"))))

    async def busy(self) -> list[tuple[int, bool]]:
        async with self.http.get(self.base_url + "/slots") as response:
            return [(s["id"], s["is_processing"]) for s in await response.json()]


async def conversation(server: Session) -> list[Any]:
    prompt = (await server.post("/tokenize", {"content": PROMPT}))["tokens"]
    server.log.append(("tokens", prompt))
    first = (await server.completion(prompt, 8))[0]
    context = prompt + first["tokens"][:-1]  # what the slot holds (the last is not cached)
    await server.slot(first["id_slot"], "save", "ctx.bin")
    others = [i for i in range(SLOTS) if i != first["id_slot"]][:2]
    for target in others:
        await server.slot(target, "restore", "ctx.bin")
    drafts = [1000, 2000, 3000]
    rounds = await server.completion([context + drafts[:i] for i in range(4)], 1)
    context = context + drafts[:1] + rounds[1]["tokens"]  # one accepted, then a correction
    drafts = [4000, 5000]
    rounds = await server.completion([context + drafts[:i] for i in range(3)], 1)
    context = context + rounds[0]["tokens"]
    follow = (await server.post("/tokenize", {"content": " Then what happened?"}))["tokens"]
    await server.completion(context + follow, 6)
    await server.completion([[*context, 6000 + i] for i in range(SLOTS + 2)], 1)  # deferred
    await server.slot(first["id_slot"], "erase")
    await server.completion(prompt, 2)  # a slot that had it is gone: which one is chosen
    server.log.append(("slots", await server.busy()))
    return server.log


async def users_taking_turns(server: Session) -> list[Any]:
    """One slot with the RAM prompt cache on (llama-server's default): a second user's
    prompt pushes the first one's out of the slot, and the first user's next turn gets
    it back from the cache."""
    first = (await server.post("/tokenize", {"content": PROMPT}))["tokens"]
    other = await server.post("/tokenize", {"content": "Write a limerick about tea."})
    answer = (await server.completion(first, 4))[0]
    await server.completion(other["tokens"], 4)
    await server.completion(first + answer["tokens"][:3], 4)  # the first user's next turn
    await server.completion(other["tokens"] + [6000], 2)
    return server.log


async def both_logs(
    tmp_path: Path, real_binary: Path, model: Path, flags: list[str], script: Any
) -> tuple[list[Any], list[Any]]:
    """The same script against a real llama-server and the regime server."""
    launcher = write_launcher("h200-cuda-14b-f16", tmp_path / "regime-server")
    logs = []
    for name, binary in (("llama-server", real_binary), ("regime", launcher)):
        slots = tmp_path / f"slots-{name}"
        slots.mkdir()
        server = LlamaServerProcess(
            binary, model, [*flags, "--slot-save-path", str(slots)],
            log_path=tmp_path / f"{name}.log",
        )  # fmt: skip
        await server.start(300)
        try:
            async with aiohttp.ClientSession() as http:
                logs.append(await script(Session(http, server.base_url)))
        finally:
            await server.stop()
    return logs[0], logs[1]


@pytest.mark.timeout(600)
async def test_the_regime_server_serves_as_llama_server_does(
    llama_server_bin: Path, demo_models: Path, tmp_path: Path
) -> None:
    real, emulated = await both_logs(
        tmp_path, llama_server_bin, demo_models / "target.gguf", FLAGS, conversation
    )
    assert len(real) == len(emulated)
    for step, (want, got) in enumerate(zip(real, emulated, strict=True)):
        assert got == want, f"step {step}: llama-server {want}, regime server {got}"


@pytest.mark.timeout(600)
async def test_the_prompt_cache_gives_a_returning_user_his_prompt_back(
    llama_server_bin: Path, demo_models: Path, tmp_path: Path
) -> None:
    flags = ["-np", "1", "-c", "1024", "--metrics", "-t", "2"]  # -cram left at its default
    real, emulated = await both_logs(
        tmp_path, llama_server_bin, demo_models / "target.gguf", flags, users_taking_turns
    )
    assert real[3][0][0][3] > 0, f"the returning user's prompt was not reused: {real}"
    assert emulated == real


async def test_streams_and_a_dropped_client_free_the_slot(tmp_path: Path) -> None:
    """Streamed /completion (no [DONE]) and chat ([DONE]) as llama-server sends them; a
    client that goes away mid-stream frees its slot."""
    launcher = write_launcher("strix-halo-vulkan-14b", tmp_path / "regime-server")
    server = LlamaServerProcess(launcher, tmp_path / "regime.gguf", FLAGS)
    await server.start(120)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [785, 326, 57909], "n_predict": 3, "temperature": 0, "stream": True}
            async with http.post(server.base_url + "/completion", json=body) as response:
                events = [line for line in (await response.text()).split("\n\n") if line]
            assert len(events) == 4 and all(e.startswith("data: {") for e in events)
            assert '"stop": true' in events[-1] and '"tokens_predicted": 3' in events[-1]
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                    "temperature": 0, "stream": True}  # fmt: skip
            async with http.post(server.base_url + "/v1/chat/completions", json=chat) as response:
                text = await response.text()
            assert text.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in text
            body = {**body, "n_predict": 400}  # about 17 s at the 14B's step: dropped early
            async with http.post(server.base_url + "/completion", json=body) as response:
                await response.content.readline()
            for _ in range(100):
                async with http.get(server.base_url + "/slots") as response:
                    if not any(s["is_processing"] for s in await response.json()):
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the dropped stream's slot is still processing")
    finally:
        await server.stop()
