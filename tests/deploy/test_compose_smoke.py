"""scripts/compose_smoke.sh without a container engine: its override drops only the
hardware, its llama-server stand-in is laid out as compose.yaml expects, the env file it
writes names real settings, and its greedy check tells equal, near-tie and wrong apart."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.server.server_install import BASE_CMAKE_ARGS, SERVER_TARGET
from tests.deploy import smoke_checks
from tests.deploy.stack import REPO, raw_compose, read_env_file

SCRIPT = REPO / "scripts" / "compose_smoke.sh"
OVERRIDE = REPO / "tests" / "deploy" / "compose.smoke.yaml"
STAND_IN = REPO / "tests" / "deploy" / "llama-server.Containerfile"
HARDWARE = {"devices", "group_add"}


class _Reset:
    """Compose's `!reset` tag: the key goes back to unset."""


def _load_override() -> dict[str, Any]:
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!reset", lambda *_: _Reset())
    return yaml.load(OVERRIDE.read_text(), Loader=loader)  # a SafeLoader with one tag more


def test_the_override_drops_the_hardware_and_nothing_else() -> None:
    override = _load_override()
    assert set(override) == {"services"}
    services = raw_compose()["services"]
    for name, changes in override["services"].items():
        assert name in services, name
        assert set(changes) <= HARDWARE, f"{name}: the override changes {set(changes)}"
        assert all(isinstance(value, _Reset) for value in changes.values()), name
    # every service compose.yaml gives hardware loses it, so the stack runs without any
    for name, service in services.items():
        assert HARDWARE & set(service) <= set(override["services"].get(name, {})), name


def test_the_stand_in_server_is_laid_out_as_compose_expects() -> None:
    text = STAND_IN.read_text()
    server = raw_compose()["services"]["llama-server"]
    (script,) = server["command"]
    binary = re.search(r"exec (\S+)", script).group(1)
    assert f"COPY --from=build /build/bin/{SERVER_TARGET} {binary}" in text
    health_tool = server["healthcheck"]["test"][1]  # CMD <tool> ...
    assert re.search(rf"apt-get install [^\n]*\b{health_tool}\b", text)
    assert f"--target {SERVER_TARGET}" in text and "$CMAKE_ARGS" in text
    # the script builds it with the options `npu-spec install-server` uses
    smoke = SCRIPT.read_text()
    assert "BASE_CMAKE_ARGS" in smoke and "fetch_source()" in smoke
    assert "-DGGML_NATIVE=OFF" in BASE_CMAKE_ARGS  # an image must run on any x86-64


def test_the_script_is_strict_bash_that_always_cleans_up() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    assert "trap cleanup EXIT" in text and "compose down -v" in text
    assert 'rm -rf "$WORK"' in text


def test_the_env_file_the_script_writes_names_real_settings() -> None:
    written = re.findall(r'^\s*echo "([A-Z_]+)=', SCRIPT.read_text(), re.M)
    assert {"MODELS_DIR", "DRAFTER_DIR", "TARGET_MODEL", "NPU_SPEC_API_KEY", "LLAMA_IMAGE"} <= set(
        written
    )
    assert set(written) <= set(read_env_file()), "compose.yaml reads no such variable"


# --- the greedy check against stand-in servers -------------------------------------------


def _server(content: str, header: str | None, top: list[tuple[int, float]]) -> web.Application:
    """A chat server answering `content`; tokens are characters; `top` is what its
    /completion shows as the top two (id, logprob) after any context."""
    counters = {"draft": 0}

    async def chat(_: web.Request) -> web.Response:
        counters["draft"] += 4
        body = {
            "choices": [{"message": {"content": content}}],
            "usage": {"completion_tokens": len(content)},
        }
        return web.json_response(body, headers={smoke_checks.SPEC_HEADER: header} if header else {})

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [ord(c) for c in (await request.json())["content"]]})

    async def template(_: web.Request) -> web.Response:
        return web.json_response({"prompt": "p"})

    async def completion(_: web.Request) -> web.Response:
        probs = [{"id": i, "logprob": lp} for i, lp in top]
        return web.json_response({"completion_probabilities": [{"top_logprobs": probs}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"npu_spec_draft_tokens_total {counters['draft']}\n")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/apply-template", template)
    app.router.add_post("/completion", completion)
    app.router.add_get("/metrics", metrics)
    return app


async def _greedy(proxy_answer: str, header: str | None, top: list[tuple[int, float]]) -> None:
    reference = TestServer(_server("abcd", None, top))
    proxy = TestServer(_server(proxy_answer, header, top))
    async with reference, proxy:
        await smoke_checks.greedy(
            str(proxy.make_url("")).rstrip("/"), str(reference.make_url("")).rstrip("/"), "k"
        )


async def test_greedy_check_passes_an_equal_answer(capsys) -> None:
    await _greedy("abcd", "speculative", [])
    out = capsys.readouterr().out
    assert "equal to llama-server alone, 4 of 4 tokens" in out and "4 tokens drafted" in out


async def test_greedy_check_passes_a_proven_near_tie_only(capsys) -> None:
    near = [(ord("c"), -0.69), (ord("x"), -0.70)]
    await _greedy("abxd", "speculative", near)
    assert "proven near-tie at token 2" in capsys.readouterr().out
    with pytest.raises(smoke_checks.CheckFailed, match="no near-tie"):
        await _greedy("abxd", "speculative", [(ord("c"), -0.1), (ord("x"), -2.5)])


@pytest.mark.parametrize("header", [None, "passthrough"])
async def test_greedy_check_wants_a_speculative_answer(header: str | None) -> None:
    with pytest.raises(smoke_checks.CheckFailed, match="not speculative"):
        await _greedy("abcd", header, [])
