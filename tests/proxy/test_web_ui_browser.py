"""llama.cpp's own web UI, in headless Chromium, chatting through the proxy.

The UI (built from the pinned source by scripts/web_ui_setup.sh) is served by the
speculative llama-server (`--path`) and loads through the proxy's pass-through; its
chat requests must be served speculatively and answer exactly as llama-server alone
does on the same conversation. Both servers run at `--temp 0` (the UI then sends no
temperature, as shipped); the UI's *Max tokens* setting keeps the answers short.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from proxy.server.llama_server import LlamaServerProcess
from proxy.server.managed import managed_server
from tests.proxy.conftest import CTX, LOG_DIR, SPEC_LAYOUT, run_proxy
from tests.proxy.helpers import chat_prompt_tokens, parse_sse, server_pair, stable_length
from tests.proxy.test_clients_server import assert_same_stream

pytestmark = [pytest.mark.server]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".cache" / "test-artifacts" / "web-ui"
TURNS = ["Name three rivers in Europe.", "And three mountains?"]
N_PREDICT = 12  # the UI's max_tokens setting


SETUP = REPO / "scripts" / "web_ui_setup.sh"
CANNOT = 3  # web_ui_setup.sh: a tool cannot be had on this machine


def setup_web_ui(env: dict[str, str]) -> dict[str, str]:
    """dist folder, chromium, playwright-core's node_modules (built once, cached).
    Where the setup cannot get a tool it says why in one line: a skip, except under
    CI, where the browser test must run."""
    done = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        env={**env, "PYTHON": sys.executable},
        cwd=REPO,
        timeout=1200,
    )
    if done.returncode == CANNOT and env.get("CI", "").lower() not in ("true", "1"):
        pytest.skip(f"web UI browser test: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"scripts/web_ui_setup.sh failed:\n{done.stderr[-3000:]}"
    dist, chromium, node_modules = done.stdout.split()
    return {"dist": dist, "chromium": chromium, "node_modules": node_modules}


@pytest.fixture(scope="module")
def web_ui_tools() -> dict[str, str]:
    return setup_web_ui(dict(os.environ))


@pytest.fixture
async def greedy_servers(
    llama_server_bin, demo_models, web_ui_tools, tmp_path
) -> AsyncIterator[tuple[str, str]]:
    greedy = ["--temp", "0"]
    ref = LlamaServerProcess(
        llama_server_bin,
        demo_models / "target.gguf",
        ["-t", "1", "-c", str(CTX), "-np", "1", *greedy],
        log_path=LOG_DIR / "web-ui-ref.log",
    )
    spec = managed_server(
        demo_models / "target.gguf",
        SPEC_LAYOUT,
        binary=llama_server_bin,
        threads=1,
        slot_save_dir=tmp_path / "slots",
        extra_args=[*greedy, "--path", web_ui_tools["dist"]],
        log_path=LOG_DIR / "web-ui-spec.log",
    )
    async with server_pair(ref, spec) as urls:
        yield urls


def streamed_text(events: list[dict]) -> tuple[str, str]:
    content = reasoning = ""
    for event in events:
        for choice in event.get("choices", []):
            content += choice["delta"].get("content") or ""
            reasoning += choice["delta"].get("reasoning_content") or ""
    return content, reasoning


async def test_web_ui_chat_in_a_browser(greedy_servers, reference_drafter, web_ui_tools):
    ref, spec = greedy_servers
    # a connection per request: llama-server closes kept-alive ones after a stream
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        await _chat_in_a_browser(http, ref, spec, reference_drafter, web_ui_tools)
    finally:
        await http.close()


async def _chat_in_a_browser(http, ref, spec, reference_drafter, web_ui_tools):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # Chromium's profile (web-ui-chromium-*) and its other files go to TMPDIR: one
    # folder of this test's, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="npu-spec-web-ui-") as scratch:
        async with run_proxy(spec, reference_drafter, 3) as proxy:
            driver = await asyncio.create_subprocess_exec(
                "node", str(REPO / "scripts" / "web_ui_chat.mjs"), proxy.url + "/",
                str(ARTIFACTS), *TURNS,
                env={**os.environ, "NODE_PATH": web_ui_tools["node_modules"],
                     "CHROMIUM": web_ui_tools["chromium"], "TMPDIR": scratch,
                     "UI_SETTINGS": json.dumps({"max_tokens": N_PREDICT})},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            output, _ = await asyncio.wait_for(driver.communicate(), timeout=300)
            metrics = proxy.state.metrics
    print(f"web UI screenshot: {ARTIFACTS / 'chat.png'}")
    log = output.decode(errors="replace")
    assert driver.returncode == 0, log
    turns = json.loads((ARTIFACTS / "turns.json").read_text())
    assert len(turns) == len(TURNS), log
    assert (ARTIFACTS / "chat.png").stat().st_size > 0

    for i, turn in enumerate(turns):
        request = turn["request"]
        # the UI's own request, as its source builds it
        assert request["timings_per_token"] is True and request["return_progress"] is True
        assert request["reasoning_format"] == "auto" and request["stream"] is True
        assert request["max_tokens"] == N_PREDICT and "temperature" not in request
        assert {t["function"]["name"] for t in request["tools"]} >= {"get_datetime"}
        assert [m["content"] for m in request["messages"] if m["role"] == "user"] == TURNS[: i + 1]
        assert turn["status"] == 200 and turn["headers"]["x-npu-spec"] == "speculative", turn
        events, done = parse_sse(turn["body"].encode())
        assert done, turn["body"][-500:]

        # llama-server alone, same conversation, same body
        prompt = await chat_prompt_tokens(http, ref, request)
        assert await stable_length(http, ref, prompt, N_PREDICT) == N_PREDICT, (
            "a near-tie inside the answer: pick other TURNS"
        )
        async with http.post(ref + "/v1/chat/completions", json=request) as response:
            expected, expected_done = parse_sse(await response.read())
        assert expected_done
        assert streamed_text(events) == streamed_text(expected), f"turn {i + 1}"
        content, _ = streamed_text(events)
        assert content.strip(), "empty answer"
        # the page shows the answer (rendered as markdown: compare the words)
        words = [w for w in content.split() if w.isalnum()]
        shown = turn["answer_text"]
        assert words and sum(w in shown for w in words) >= len(words) / 2, (content, shown)
        # chunk by chunk as the server's: timings on each token, progress first
        assert_same_stream((events, done), (expected, expected_done))

    # the second turn reused the first turn's conversation in the server's cache
    final_timings = parse_sse(turns[1]["body"].encode())[0][-1]["timings"]
    assert final_timings["cache_n"] > 0, final_timings
    # both chat turns drafted and verified (the page's other requests passed through)
    assert metrics.requests["speculative"] == len(TURNS) and metrics.rounds >= len(TURNS)


def test_without_a_browser_the_test_skips_with_the_reason(tmp_path: Path) -> None:
    """No chromium and no apt-get: one line says why, and the browser test skips;
    under CI the same is a failure."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "id", "dirname"):
        (tools / name).symlink_to(shutil.which(name))
    for name in ("node", "npm"):  # present; chromium and apt-get are not
        (tools / name).write_text("#!/bin/sh\nexit 0\n")
        (tools / name).chmod(0o755)
    env = {**os.environ, "PATH": str(tools), "CI": "false"}
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed"):
        setup_web_ui(env)
    with pytest.raises(AssertionError, match=r"web_ui_setup\.sh failed"):
        setup_web_ui({**env, "CI": "true"})
