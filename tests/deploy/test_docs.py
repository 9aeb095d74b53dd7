"""docs/STRIX_HALO.md and docs/CLIENTS.md say what the code and the stack do: commands
parse, settings, ports, routes, metric names and quoted output come from the code."""

from __future__ import annotations

import http.server
import json
import logging
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from proxy import cli, doctor
from proxy.api.app import create_app
from proxy.api.guard import GuardSettings
from proxy.config import ProxySettings
from proxy.metrics import ProxyMetrics
from proxy.server.managed import ServerLayout
from tests.deploy.stack import (
    CLIENTS_DOC,
    REPO,
    STRIX_DOC,
    code_blocks,
    load_compose,
    read_env_file,
    stack_env,
)

STRIX, CLIENTS = STRIX_DOC, CLIENTS_DOC
DOCS = (STRIX, CLIENTS)
# Subcommands being added in parallel: their lines are checked as soon as they exist.
UPCOMING = {"bench"}


def shell_commands(path: Path) -> list[list[str]]:
    """Commands of the doc's shell blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line))
    return commands


def test_settings_table_matches_env_example() -> None:
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", STRIX.read_text(), re.M))
    example = read_env_file()
    assert set(rows) == set(example)
    compose_text = (REPO / "compose.yaml").read_text()
    for name, value in example.items():
        documented = rows[name].strip()
        if f"${{{name}:?" in compose_text:
            assert documented == "(required)", name
        elif value:
            assert documented == f"`{value}`", name
        else:
            assert documented == "(empty)", name


def test_npu_spec_commands_in_the_docs_parse(monkeypatch) -> None:
    seen = set()
    for path in DOCS:
        for command in shell_commands(path):
            if command[0] != "npu-spec":
                continue
            sub = command[1]
            if sub in UPCOMING and sub not in cli.SUBCOMMANDS:
                continue
            assert sub in cli.SUBCOMMANDS, f"{path.name}: no subcommand {sub!r}"
            monkeypatch.setattr(sys, "argv", command)
            cli.build_parser().parse_args(command[1:])  # exits on an unknown option
            seen.add(sub)
    assert {"serve", "export-drafter", "install-server"} <= seen


def test_compose_commands_name_real_services_and_profiles() -> None:
    services = set(load_compose(stack_env())["services"])
    profiles = {
        p for s in load_compose(stack_env())["services"].values() for p in s.get("profiles", [])
    }
    checked = 0
    for path in DOCS:
        for command in shell_commands(path):
            if command[:2] != ["docker", "compose"]:
                continue
            words = command[2:]
            while words and words[0] == "--profile":
                assert words[1] in profiles, f"{path.name}: no profile {words[1]}"
                words = words[2:]
            action, rest = words[0], [w for w in words[1:] if not w.startswith("-")]
            named = rest[:1] if action in ("run", "exec") else rest
            if action in ("run", "exec", "logs", "up", "restart", "build", "ps"):
                assert set(named) <= services, f"{path.name}: {' '.join(command)}"
                checked += 1
    assert checked >= 5


def test_urls_use_the_ports_the_stack_publishes() -> None:
    env = read_env_file()
    host_ports = {"PROXY_PORT", "LLAMA_PORT", "AB_PORT"}
    stack = load_compose(stack_env())["services"]
    for path, allowed in ((CLIENTS, {"PROXY_PORT"}), (STRIX, host_ports)):
        text = path.read_text()
        for port in re.findall(r"(?:localhost|127\.0\.0\.1):(\d+)", text):
            if path == CLIENTS and port == "3000":  # Open WebUI's own page
                continue
            assert port in {env[name] for name in allowed}, f"{path.name}: port {port}"
        # inside the compose network: service name and the port it listens on
        for service, port in re.findall(r"http://(npu-spec|llama-server):(\d+)", text):
            published = stack[service]["ports"][0].rsplit(":", 1)[1]
            assert port == published, f"{path.name}: {service}:{port}"


def test_every_route_the_proxy_registers_is_documented() -> None:
    text = CLIENTS.read_text()
    # routing only: no request reaches the state, which needs just its guard settings
    app = create_app(SimpleNamespace(guard=GuardSettings()))
    paths = {route.resource.canonical for route in app.router.routes()} - {"/{tail}"}
    for path in paths | {"/v1/models", "/health"}:
        assert f"{path}`" in text, f"CLIENTS.md does not mention {path}"


def test_metric_names_in_the_docs_exist() -> None:
    exposed = set(re.findall(r"npu_spec_[a-z_]+", ProxyMetrics().render()))
    for path in DOCS:
        for name in re.findall(r"npu_spec_[a-z_]+", path.read_text()):
            assert name in exposed, f"{path.name}: no metric {name}"


def test_layout_example_is_the_default_layout() -> None:
    defaults = {name: ProxySettings.model_fields[name].default for name in
                ("k", "ctx", "conversations", "passthrough_slots")}  # fmt: skip
    layout = ServerLayout(
        defaults["k"], defaults["ctx"], defaults["conversations"], defaults["passthrough_slots"]
    )
    text = STRIX.read_text()
    assert f"(the defaults give {defaults['conversations']} × {layout.group_size} + " in text
    assert f"= {layout.slots})" in text
    assert f"{layout.slots} × {layout.slot_ctx:,} = {layout.total_ctx:,}" in text


def test_doctor_lines_quoted_in_the_docs(monkeypatch) -> None:
    import onnxruntime

    text = STRIX.read_text()
    monkeypatch.setattr(
        onnxruntime, "get_available_providers",
        lambda: ["VitisAIExecutionProvider", "CPUExecutionProvider"],
    )  # fmt: skip
    yes = next(line.strip() for line in doctor.onnxruntime_report() if "NPU:" in line)
    assert f"`{yes}`" in text
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    no = next(line.strip() for line in doctor.onnxruntime_report() if "NPU:" in line)
    assert no.startswith("NPU: no") and "a line starting `NPU: no`" in text


def test_drafter_log_line_quoted_in_the_docs(monkeypatch, caplog) -> None:
    import npu_draft.load
    from proxy import serve_cmd

    class Info:
        name, backend, provider = "Qwen3-0.6B", "genai", "npu"

    class Model:
        info = Info()

    monkeypatch.setattr(npu_draft.load, "load_drafter", lambda *args, **kwargs: Model())
    settings = ProxySettings(upstream="http://llama-server:8080", drafter="/drafter")
    with caplog.at_level(logging.INFO, logger=serve_cmd.__name__):
        serve_cmd._drafter_opener(settings)
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drafter")]
    assert f"`{message}`" in STRIX.read_text()


@pytest.fixture
def fake_proxy() -> Iterator[tuple[str, list[dict]]]:
    """Answers /v1/models and /v1/chat/completions in llama-server's shapes."""
    requests: list[dict] = []
    base = {"id": "chatcmpl-1", "created": 0, "model": "qwen3-32b", "system_fingerprint": "b1"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Npu-Spec", "speculative")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            data = [{"id": "qwen3-32b", "object": "model", "created": 0, "owned_by": "llamacpp"}]
            self._send(json.dumps({"object": "list", "data": data}).encode(), "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append({"path": self.path, **body})
            if not body.get("stream"):
                answer = {**base, "object": "chat.completion", "timings": {"draft_n": 8},
                          "choices": [{"index": 0, "finish_reason": "stop", "message":
                                       {"role": "assistant", "content": "2, 3 and 5."}}],
                          "usage": {"prompt_tokens": 5, "completion_tokens": 6,
                                    "total_tokens": 11}}  # fmt: skip
                self._send(json.dumps(answer).encode(), "application/json")
                return
            chunks = [
                {**base, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "finish_reason": None, "delta": {"content": word}}]}
                for word in ("1 2 ", "3 4 5")
            ]  # fmt: skip
            stream = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)
            self._send((stream + "data: [DONE]\n\n").encode(), "text/event-stream")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()


def test_openai_client_example_runs(fake_proxy) -> None:
    url, requests = fake_proxy
    (snippet,) = code_blocks(CLIENTS, "python")
    assert snippet.count("http://localhost:8080") == 1
    done = subprocess.run(
        [sys.executable, "-c", snippet.replace("http://localhost:8080", url)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["speculative 2, 3 and 5.", "{'draft_n': 8}", "1 2 3 4 5"]
    assert [r["path"] for r in requests] == ["/v1/chat/completions"] * 2
    assert all(r["temperature"] == 0 and r["model"] == "qwen3-32b" for r in requests)
