"""Dockerfile: the image runs the real `npu-spec serve`, configured as compose.yaml says,
as a non-root user, with runtime dependencies only and a health check that means it."""

from __future__ import annotations

import http.server
import importlib
import os
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy import cli
from proxy.config import ProxySettings
from proxy.serve_cmd import settings_from_args
from tests.deploy.stack import (
    REPO,
    build_args,
    dockerfile_instructions,
    dockerignored,
    env_instructions,
    exec_form,
    final_stage,
    last_instruction,
    load_compose,
    stack_env,
)

INSTRUCTIONS = dockerfile_instructions()
FINAL = final_stage(INSTRUCTIONS)
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _last(keyword: str) -> str:
    return last_instruction(FINAL, keyword)


def test_entrypoint_is_the_installed_console_script() -> None:
    assert exec_form(_last("ENTRYPOINT")) == ["npu-spec"]
    target = PYPROJECT["project"]["scripts"]["npu-spec"]
    module, _, function = target.partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main


def _parse_cmd(monkeypatch) -> object:
    command = exec_form(_last("CMD"))
    # proxy.cli adds a subcommand's options when that subcommand is on sys.argv
    monkeypatch.setattr(sys, "argv", ["npu-spec", *command])
    return cli.build_parser().parse_args(command)


def test_cmd_is_the_serve_subcommand_with_options_it_accepts(monkeypatch) -> None:
    command = exec_form(_last("CMD"))
    assert command[0] == "serve"
    assert cli.SUBCOMMANDS["serve"][0] == "proxy.serve_cmd"
    args = _parse_cmd(monkeypatch)
    assert args._module == "proxy.serve_cmd"


def test_image_environment_names_proxy_settings() -> None:
    image_env = env_instructions(FINAL)
    fields = ProxySettings.model_fields
    names = [name for name in image_env if name.startswith("NPU_SPEC_")]
    assert names, "the image must set NPU_SPEC_HOST"
    for name in names:
        assert name.removeprefix("NPU_SPEC_").lower() in fields, name
    assert image_env["NPU_SPEC_HOST"] == "0.0.0.0"  # the proxy's default is 127.0.0.1


def test_the_stack_configures_the_proxy_it_describes(monkeypatch) -> None:
    """Resolve the settings exactly as the container does: image ENV, then the compose
    environment on top, then the CMD's options."""
    for name in list(os.environ):
        if name.startswith("NPU_SPEC_"):
            monkeypatch.delenv(name)
    env = stack_env(NPU_SPEC_K="6", NPU_SPEC_CONVERSATIONS="2", NPU_SPEC_PROVIDER="npu")
    proxy = load_compose(env)["services"]["npu-spec"]
    container_env = {**env_instructions(FINAL), **proxy["environment"]}
    for name, value in container_env.items():
        if name.startswith("NPU_SPEC_"):
            monkeypatch.setenv(name, str(value))
    settings = settings_from_args(_parse_cmd(monkeypatch))

    assert settings.upstream == "http://llama-server:8080" and settings.target is None
    assert (settings.host, settings.port) == ("0.0.0.0", 8080)
    assert proxy["ports"] == [f"{env['BIND_ADDRESS']}:{env['PROXY_PORT']}:{settings.port}"]
    assert (settings.k, settings.conversations, settings.provider) == (6, 2, "npu")
    assert settings.drafter == "/drafter"
    assert any(volume.endswith(f":{settings.drafter}:ro") for volume in proxy["volumes"])
    assert settings.attach_policy == "refuse"


def test_runs_as_a_non_root_user() -> None:
    user = _last("USER")
    assert user not in ("root", "0") and not user.startswith(("root:", "0:"))
    useradd = " ".join(
        arguments for kw, arguments in FINAL if kw == "RUN" and "useradd" in arguments
    )
    assert user in useradd.split()
    home = f"/home/{user}/.cache"
    proxy = load_compose(stack_env())["services"]["npu-spec"]
    assert any(volume.endswith(f":{home}") for volume in proxy["volumes"])


def test_runtime_dependencies_only() -> None:
    runs = " ".join(arguments for kw, arguments in INSTRUCTIONS if kw == "RUN")
    assert "pip install /wheels/npu_spec-*.whl;" in runs
    assert "[dev]" not in runs and "[export]" not in runs and "torch" not in runs
    assert "--editable" not in runs and "pip install -e" not in runs
    # the dev extra must stay what brings PyTorch in
    assert not any("torch" in dep for dep in PYPROJECT["project"]["dependencies"])


def test_onnxruntime_build_is_chosen_by_a_build_argument() -> None:
    args = build_args(INSTRUCTIONS)
    assert args["ORT_BUILD"] == "cpu"
    stages = {arguments.split(" AS ")[-1] for kw, arguments in INSTRUCTIONS if kw == "FROM"}
    assert {"base-cpu", "base-vitisai"} <= stages
    assert _last("FROM") == "base-${ORT_BUILD}"
    base_cpu = next(a for kw, a in INSTRUCTIONS if kw == "FROM" and a.endswith("AS base-cpu"))
    assert base_cpu.startswith(("python:3.11-slim", "python:3.12-slim"))
    compose_build = load_compose(stack_env())["services"]["npu-spec"]["build"]
    assert compose_build["args"]["ORT_BUILD"] == args["ORT_BUILD"]


def test_build_context_holds_what_the_image_installs_and_nothing_heavy() -> None:
    needed = [
        "pyproject.toml",
        PYPROJECT["project"]["readme"],
        "npu-packages/onnxruntime_vitisai-1.0-cp312-cp312-linux_x86_64.whl",
    ]
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        needed += [
            str(path.relative_to(REPO))
            for path in (REPO / package).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        ]
    left_out = [path for path in needed if dockerignored(path)]
    assert not left_out
    heavy = [
        ".venv/bin/python",
        ".cache/test-models/x",
        ".models/demo/target.gguf",
        "target.gguf",
        ".git/HEAD",
        "tests/conftest.py",
        "proxy/__pycache__/cli.pyc",
    ]
    assert all(dockerignored(path) for path in heavy)


@pytest.fixture
def health_server() -> Iterator[tuple[int, list[int]]]:
    """A stand-in proxy whose /health answers with the status at the list's end."""
    status = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[-1] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], status
    finally:
        server.shutdown()


def _run_check(command: list[str], port: int) -> int:
    assert command[0] == "python"
    env = {"PATH": os.environ["PATH"], "NPU_SPEC_PORT": str(port)}
    return subprocess.run([sys.executable, *command[1:]], env=env, timeout=30).returncode


def test_healthcheck_passes_only_when_health_answers_ok(health_server) -> None:
    port, status = health_server
    arguments = _last("HEALTHCHECK")
    options, _, command = arguments.partition("CMD ")
    assert "--start-period=" in options
    command = exec_form(command)
    assert _run_check(command, port) == 0
    status.append(503)  # llama-server still loading: the proxy passes its 503 on
    assert _run_check(command, port) != 0
    # and it asks the port the proxy listens on by default
    default_port = ProxySettings.model_fields["port"].default
    assert env_instructions(FINAL)["NPU_SPEC_PORT"] == str(default_port)


def _run_parts(arguments: str) -> tuple[list[str], str]:
    """A RUN instruction's --mount options and its shell script."""
    mounts = []
    while arguments.startswith("--mount="):
        option, _, arguments = arguments.partition(" ")
        mounts.append(option.removeprefix("--mount="))
        arguments = arguments.lstrip()
    return mounts, arguments


def _stage(name: str) -> list[tuple[str, str]]:
    start = next(
        i for i, (kw, a) in enumerate(INSTRUCTIONS) if kw == "FROM" and a.endswith(f" AS {name}")
    )
    end = next(i for i in range(start + 1, len(INSTRUCTIONS)) if INSTRUCTIONS[i][0] == "FROM")
    return INSTRUCTIONS[start:end]


def _pip_run() -> tuple[list[str], str]:
    (run,) = [a for kw, a in FINAL if kw == "RUN" and "pip install /wheels/" in a]
    return _run_parts(run)


def test_the_host_ca_bundle_is_a_build_secret_never_a_layer() -> None:
    (wheel_run,) = [_run_parts(a) for kw, a in _stage("wheel") if kw == "RUN"]
    secret = "type=secret,id=ca-certificates,target=/run/secrets/ca-certificates"
    for mounts, script in (_pip_run(), wheel_run):  # every RUN that downloads from PyPI
        assert secret in mounts
        # pip trusts the bundle only when the builder was given it
        assert "if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=" in script
    for keyword, arguments in INSTRUCTIONS:
        assert "update-ca-certificates" not in arguments, arguments
        assert not (keyword == "ENV" and "PIP_CERT" in arguments), arguments


def test_the_image_gets_the_wheel_not_the_sources() -> None:
    """Sources are copied into the wheel stage only (a bind mount of the context that pip
    writes to would write into the checkout with podman); the image has no COPY or ADD."""
    assert not [kw for kw, _ in FINAL if kw in ("COPY", "ADD")]
    copied = [a.split()[:-1] for kw, a in _stage("wheel") if kw == "COPY"]
    sources = {source.rstrip("/") for group in copied for source in group}
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert sources == {"pyproject.toml", PYPROJECT["project"]["readme"]} | packages
    ((_, script),) = [_run_parts(a) for kw, a in _stage("wheel") if kw == "RUN"]
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src" in script
    assert "type=bind,from=wheel,source=/wheels,target=/wheels" in _pip_run()[0]
    assert not any(",rw" in mount for mount in _pip_run()[0])


@pytest.fixture
def vitisai_run(tmp_path) -> tuple[str, Path]:
    """The base-vitisai RUN with the build context at tmp_path/src and apt-get faked."""
    ((mounts, script),) = [_run_parts(a) for kw, a in _stage("base-vitisai") if kw == "RUN"]
    # the whole context: a bind mount of npu-packages/ fails without that folder, before
    # the one-line message could say what is missing
    assert mounts == ["type=bind,source=.,target=/src"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apt-get"
    fake.write_text(f'#!/bin/sh\necho "apt-get $*" >> {tmp_path}/apt.log\n')
    fake.chmod(0o755)
    (tmp_path / "src").mkdir()
    assert script.count("/var/lib/apt/lists/") == 1  # never the host's own lists
    script = script.replace("/src/", f"{tmp_path}/src/")
    script = script.replace("/var/lib/apt/lists/", f"{tmp_path}/lists/")
    return script, tmp_path


def _sh(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)


def test_vitisai_build_stops_with_one_line_where_amds_packages_are_needed(vitisai_run) -> None:
    script, tmp_path = vitisai_run
    done = _sh(script, tmp_path)
    assert done.returncode != 0
    assert done.stderr == "ORT_BUILD=vitisai: put AMD's XRT *.deb files in npu-packages/\n"
    assert not (tmp_path / "apt.log").exists()  # stopped before installing anything

    (tmp_path / "src" / "npu-packages").mkdir()
    (tmp_path / "src" / "npu-packages" / "xrt_202520.deb").write_bytes(b"")
    done = _sh(script, tmp_path)
    assert done.returncode == 0, done.stderr
    installed = (tmp_path / "apt.log").read_text()
    assert f"{tmp_path}/src/npu-packages/xrt_202520.deb" in installed


def test_vitisai_wheels_are_checked_with_one_line_too() -> None:
    _, script = _pip_run()
    assert (
        'ls /src/npu-packages/*.whl >/dev/null 2>&1 || { echo "ORT_BUILD=vitisai: put the '
        'Ryzen AI *.whl files in npu-packages/" >&2; exit 1; }'
    ) in " ".join(script.split())
