"""The stack without containers: llama-server started by compose.yaml's own entrypoint
script, the proxy started by the image's ENTRYPOINT and CMD with the environment the
image and compose.yaml give it, both health checks, and the openai example of
docs/CLIENTS.md answered speculatively.

Only what a container engine would add is swapped: the real pinned llama-server binary
for /app/llama-server, host folders for the mounts, and free local ports (with the
service name replaced by 127.0.0.1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.server.llama_server import free_port
from tests.deploy.stack import (
    CLIENTS_DOC,
    code_blocks,
    dockerfile_instructions,
    env_instructions,
    exec_form,
    final_stage,
    last_instruction,
    load_compose,
    stack_env,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]
LOG_DIR = Path(__file__).resolve().parents[2] / ".cache" / "test-logs"


def _wait(check, what: str, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what} exited with {process.returncode}"
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not healthy after {timeout:.0f} s")


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_stack_serves_the_clients_example(llama_server_bin, demo_models, tmp_path, processes):
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = stack_env(TARGET_MODEL="target.gguf", LLAMA_ARGS="-t 2")
    stack = load_compose(env)["services"]

    # llama-server: the service's shell script, as the image's /bin/sh runs it
    server = stack["llama-server"]
    server_port = free_port()
    (script,) = server["command"]
    for old, new in (
        ("/app/llama-server", str(llama_server_bin)),
        ('"/models/', f'"{demo_models}/'),
        ("--slot-save-path /slots", f"--slot-save-path {tmp_path}"),
        ("--port 8080", f"--port {server_port}"),
    ):
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    server_env = {k: str(v) for k, v in server["environment"].items()}
    with open(LOG_DIR / "deploy-llama-server.log", "wb") as log:
        processes.append(
            subprocess.Popen(
                ["sh", "-c", script],
                env={"PATH": os.environ["PATH"], **server_env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    health = server["healthcheck"]["test"][-1].replace(":8080/", f":{server_port}/")
    _wait(lambda: _ok(health), "llama-server", processes[0])

    # the proxy: ENTRYPOINT + CMD, image ENV under the compose environment
    proxy = stack["npu-spec"]
    proxy_port = free_port()
    image = final_stage(dockerfile_instructions())
    proxy_env = {**env_instructions(image), **proxy["environment"]}
    proxy_env = {k: str(v) for k, v in proxy_env.items()}
    assert proxy_env["NPU_SPEC_UPSTREAM"] == "http://llama-server:8080"
    assert proxy_env["NPU_SPEC_DRAFTER"] == "/drafter"
    proxy_env |= {
        "NPU_SPEC_UPSTREAM": f"http://127.0.0.1:{server_port}",
        "NPU_SPEC_DRAFTER": str(demo_models / "draft"),
        "NPU_SPEC_PORT": str(proxy_port),
        "HOME": str(tmp_path),
    }
    command = [
        shutil.which(exec_form(last_instruction(image, "ENTRYPOINT"))[0]),
        *exec_form(last_instruction(image, "CMD")),
    ]
    with open(LOG_DIR / "deploy-proxy.log", "wb") as log:
        processes.append(
            subprocess.Popen(
                command,
                env={"PATH": os.environ["PATH"], **proxy_env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    check = exec_form(last_instruction(image, "HEALTHCHECK").partition("CMD ")[2])
    check_env = {"PATH": os.environ["PATH"], "NPU_SPEC_PORT": str(proxy_port)}

    def proxy_healthy() -> bool:
        run = subprocess.run([sys.executable, *check[1:]], env=check_env, capture_output=True)
        return run.returncode == 0

    _wait(proxy_healthy, "npu-spec (image HEALTHCHECK)", processes[1])
    compose_check = proxy["healthcheck"]["test"][-1].replace(":8080/", f":{proxy_port}/")
    assert subprocess.run([sys.executable, "-c", compose_check]).returncode == 0
    log_text = (LOG_DIR / "deploy-proxy.log").read_text()
    assert f"http://0.0.0.0:{proxy_port}" in log_text  # listens on every interface
    assert "backend" in log_text and " on cpu" in log_text  # says where the drafter runs

    (snippet,) = code_blocks(CLIENTS_DOC, "python")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            snippet.replace("http://localhost:8080", f"http://127.0.0.1:{proxy_port}"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("speculative "), done.stdout[:200]
    # the engine's timings: drafts it verified, or (where the gate measured the CPU
    # drafter too slow to win, as on a small machine) what its plain runs wrote
    timings = done.stdout.splitlines()[1]
    assert "draft_n" in timings or "plain_run_n" in timings, timings
