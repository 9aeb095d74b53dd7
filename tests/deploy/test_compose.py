"""compose.yaml: valid Compose, the services and wiring the docs describe, and a
llama-server sized exactly as the proxy's managed mode sizes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from proxy.config import ProxySettings
from proxy.server.managed import ServerLayout, verification_flags
from proxy.server.server_install import LLAMA_CPP_BUILD
from tests.deploy.stack import (
    COMPOSE_FILE,
    InterpolationError,
    compose_variables,
    load_compose,
    raw_compose,
    read_env_file,
    stack_env,
)

SERVER_BINARY = "/app/llama-server"  # where the official image keeps it
LAYOUT_VARIABLES = {
    "NPU_SPEC_K": "k",
    "NPU_SPEC_CONVERSATIONS": "conversations",
    "NPU_SPEC_CTX": "ctx",
    "NPU_SPEC_PASSTHROUGH_SLOTS": "passthrough_slots",
}


def compose_schema() -> dict:
    # The Compose Specification schema as check-jsonschema vendors it (no network).
    schema = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    return json.loads(schema.read_text())


@pytest.fixture(scope="module")
def stack() -> dict:
    return load_compose(stack_env())


def test_compose_file_validates_against_the_compose_specification(stack) -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    errors = [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(stack)
    ]
    assert not errors, "\n".join(errors)


def test_the_schema_check_can_fail() -> None:
    broken = load_compose(stack_env())
    broken["services"]["npu-spec"]["depends_on"]["llama-server"]["condition"] = "started"
    broken["services"]["npu-spec"]["healthcheck"]["retries"] = "three"
    validator = jsonschema.Draft202012Validator(compose_schema())
    assert len(list(validator.iter_errors(broken))) == 2


def test_env_example_lists_exactly_the_variables_compose_reads() -> None:
    read = set(compose_variables(raw_compose()))
    documented = set(read_env_file())
    assert read - documented == set(), "add these to .env.example"
    assert documented - read == set(), "compose.yaml never reads these"


def test_defaults_equal_env_example_so_a_missing_line_changes_nothing() -> None:
    example = read_env_file()
    for name, defaults in compose_variables(raw_compose()).items():
        given = defaults - {None}
        assert len(given) <= 1, f"{name} has several defaults: {given}"
        if given:
            assert given == {example[name]}, name
        else:  # no default: compose.yaml must demand it
            assert f"${{{name}:?" in COMPOSE_FILE.read_text(), f"{name} has no default"


@pytest.mark.parametrize("missing", ["TARGET_MODEL", "NPU_GID"])
def test_required_settings_stop_compose_with_a_message(missing: str) -> None:
    env = stack_env(TARGET_MODEL="t.gguf")
    env[missing] = ""
    with pytest.raises(InterpolationError, match=missing):
        load_compose(env)


def test_shipped_env_example_demands_the_npu_group() -> None:
    with pytest.raises(InterpolationError, match="NPU_GID"):
        load_compose(read_env_file())


def test_proxy_variables_are_settings_with_the_proxy_defaults() -> None:
    fields = ProxySettings.model_fields
    for name, value in read_env_file().items():
        if not name.startswith("NPU_SPEC_"):
            continue
        field = name.removeprefix("NPU_SPEC_").lower()
        assert field in fields, f"{name} is not a ProxySettings field"
        default = fields[field].default
        if default is not None and field != "drafter":
            assert str(default) == value, f"{name}={value} but the proxy defaults to {default}"


def test_services_profiles_and_start_order(stack) -> None:
    services = stack["services"]
    assert set(services) == {"llama-server", "npu-spec", "llama-server-plain"}
    assert "profiles" not in services["llama-server"]
    assert "profiles" not in services["npu-spec"]
    assert services["llama-server-plain"]["profiles"] == ["ab"]
    assert services["npu-spec"]["depends_on"] == {"llama-server": {"condition": "service_healthy"}}


def test_llama_server_image_is_the_pinned_vulkan_build(stack) -> None:
    expected = f"ghcr.io/ggml-org/llama.cpp:server-vulkan-{LLAMA_CPP_BUILD}"
    for name in ("llama-server", "llama-server-plain"):
        assert stack["services"][name]["image"] == expected


def test_devices(stack) -> None:
    services = stack["services"]
    assert "/dev/dri:/dev/dri" in services["llama-server"]["devices"]
    assert "/dev/dri:/dev/dri" in services["llama-server-plain"]["devices"]
    assert services["npu-spec"]["devices"] == ["/dev/accel:/dev/accel"]
    assert services["npu-spec"]["group_add"] == [stack_env()["NPU_GID"]]
    assert services["npu-spec"]["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


def _port(mapping: str) -> tuple[str, int, int]:
    address, host, container = mapping.rsplit(":", 2)
    return address, int(host), int(container)


def _server_command(service: dict, fake_binary: Path) -> list[str]:
    """Run the service's shell entrypoint as the container would, with the binary swapped
    for one that prints its arguments."""
    assert service["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = service["command"]
    assert script.count(SERVER_BINARY) == 1
    script = script.replace(SERVER_BINARY, str(fake_binary))
    container_env = {key: str(value) for key, value in service["environment"].items()}
    done = subprocess.run(
        ["sh", "-c", script],
        env={"PATH": os.environ["PATH"], **container_env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def fake_binary(tmp_path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    binary.chmod(0o755)
    return binary


def _option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_ports_and_health_checks_agree_with_what_listens(stack, fake_binary) -> None:
    env = stack_env()
    services = stack["services"]
    proxy = services["npu-spec"]
    (proxy_port,) = proxy["ports"]
    assert _port(proxy_port) == (env["BIND_ADDRESS"], int(env["PROXY_PORT"]), 8080)
    assert proxy["environment"]["NPU_SPEC_PORT"] == "8080"
    assert "http://127.0.0.1:8080/health" in " ".join(proxy["healthcheck"]["test"])
    assert proxy["environment"]["NPU_SPEC_HOST"] == "0.0.0.0"

    listening = {}
    for name, published in (("llama-server", "LLAMA_PORT"), ("llama-server-plain", "AB_PORT")):
        service = services[name]
        args = _server_command(service, fake_binary)
        port = listening[name] = int(_option(args, "--port"))
        assert _option(args, "--host") == "0.0.0.0"
        (mapping,) = service["ports"]
        address, host_port, container_port = _port(mapping)
        assert (host_port, container_port) == (int(env[published]), port)
        expected_address = "127.0.0.1" if name == "llama-server" else env["BIND_ADDRESS"]
        assert address == expected_address
        assert service["healthcheck"]["test"] == [
            "CMD", "curl", "-fsS", f"http://127.0.0.1:{port}/health"
        ]  # fmt: skip
    # the proxy reaches the server by its service name, on the port it listens on
    upstream = proxy["environment"]["NPU_SPEC_UPSTREAM"]
    assert upstream == f"http://llama-server:{listening['llama-server']}"


@pytest.mark.parametrize(
    ("k", "conversations", "ctx", "passthrough"),
    [(4, 1, 4096, 1), (6, 2, 8192, 0), (1, 3, 1000, 2), (8, 1, 4097, 1)],
)
def test_llama_server_flags_equal_managed_mode(k, conversations, ctx, passthrough, fake_binary):
    env = stack_env(
        NPU_SPEC_K=str(k),
        NPU_SPEC_CONVERSATIONS=str(conversations),
        NPU_SPEC_CTX=str(ctx),
        NPU_SPEC_PASSTHROUGH_SLOTS=str(passthrough),
        TARGET_MODEL="qwen3-32b.gguf",
        LLAMA_ARGS="-fa on --alias qwen3",
    )
    service = load_compose(env)["services"]["llama-server"]
    args = _server_command(service, fake_binary)

    layout = ServerLayout(k, ctx, conversations, passthrough)
    expected = verification_flags(layout, Path("/slots"))
    start = args.index(expected[0])
    assert args[start : start + len(expected)] == expected
    assert _option(args, "-m") == "/models/qwen3-32b.gguf"
    assert args[-4:] == ["-fa", "on", "--alias", "qwen3"]  # LLAMA_ARGS, split on spaces
    # what attached mode checks (proxy/server/attach_check.py): k+1 slots per conversation
    assert int(_option(args, "-np")) >= conversations * (k + 1)
    assert "/slots" in {volume.split(":")[1] for volume in service["volumes"]}


def test_plain_server_for_ab(fake_binary) -> None:
    env = stack_env(TARGET_MODEL="t.gguf", NPU_SPEC_K="6", NPU_SPEC_CTX="8192")
    plain = load_compose(env)["services"]["llama-server-plain"]
    args = _server_command(plain, fake_binary)
    assert "-md" not in args and "-kvu" not in args
    assert (_option(args, "-np"), _option(args, "-c")) == ("1", "8192")

    env["AB_DRAFT_MODEL"] = "draft.gguf"
    plain = load_compose(env)["services"]["llama-server-plain"]
    args = _server_command(plain, fake_binary)
    assert _option(args, "-md") == "/models/draft.gguf"
    assert _option(args, "--spec-type") == "draft-simple"
    assert _option(args, "--spec-draft-n-max") == "6"


def test_volumes_mount_the_folders_the_settings_name(stack) -> None:
    env = stack_env()
    proxy = stack["services"]["npu-spec"]
    mounts = {volume.split(":")[1]: volume for volume in proxy["volumes"]}
    assert mounts["/drafter"] == f"{env['DRAFTER_DIR']}:/drafter:ro"
    assert proxy["environment"]["NPU_SPEC_DRAFTER"] == env["NPU_SPEC_DRAFTER"] == "/drafter"
    for name in ("llama-server", "llama-server-plain"):
        volumes = stack["services"][name]["volumes"]
        assert f"{env['MODELS_DIR']}:/models:ro" in volumes
    assert set(stack["volumes"]) == {
        volume.split(":")[0]
        for service in stack["services"].values()
        for volume in service.get("volumes", [])
        if not volume.startswith((".", "/"))
    }


def test_proxy_image_is_built_from_the_dockerfile(stack) -> None:
    proxy = stack["services"]["npu-spec"]
    assert proxy["build"]["context"] == "."
    assert proxy["build"]["args"] == {"ORT_BUILD": stack_env()["ORT_BUILD"]}
    assert "command" not in proxy and "entrypoint" not in proxy  # the image's own


def test_every_service_reads_the_same_layout() -> None:
    env = stack_env(NPU_SPEC_K="7", NPU_SPEC_CONVERSATIONS="2", NPU_SPEC_CTX="2048")
    services = load_compose(env)["services"]
    for name, service in services.items():
        layout = {key: service["environment"].get(key) for key in LAYOUT_VARIABLES}
        assert layout == {key: env[key] for key in LAYOUT_VARIABLES}, name


@pytest.fixture
def env_binary(tmp_path) -> Path:
    """A stand-in server that prints the API-key variables it was started with."""
    binary = tmp_path / "llama-server"
    binary.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items()"
        " if 'API_KEY' in k}}))\n"
    )
    binary.chmod(0o755)
    return binary


@pytest.mark.parametrize("name", ["llama-server", "llama-server-plain"])
def test_the_api_key_guards_every_llama_server_too(name: str, env_binary: Path) -> None:
    """A key in .env is asked for by the published llama-server ports as well (no way around
    the proxy), through llama-server's own variable, never on its command line."""
    keyed = load_compose(stack_env(TARGET_MODEL="t.gguf", NPU_SPEC_API_KEY="s3cret"))
    seen = _server_command(keyed["services"][name], env_binary)
    assert seen["env"] == {"LLAMA_API_KEY": "s3cret"}
    assert not any("s3cret" in arg for arg in seen["argv"])
    assert keyed["services"]["npu-spec"]["environment"]["NPU_SPEC_API_KEY"] == "s3cret"

    open_stack = load_compose(stack_env(TARGET_MODEL="t.gguf"))
    assert read_env_file()["NPU_SPEC_API_KEY"] == ""  # the shipped default: no key
    assert _server_command(open_stack["services"][name], env_binary)["env"] == {}
