"""Every answer says who served it: X-Npu-Spec is `proxy` on the proxy's own routes
(/health, /metrics) and refusals, and a body that is not JSON is refused by the proxy
itself in the OpenAI error format."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import run_proxy

pytestmark = [pytest.mark.server]

NOT_JSON = [
    (b"{not json", "Expecting property name enclosed in double quotes at line 1 column 2"),
    (b'{"prompt": "Hi"} trailing', "Extra data at line 1 column 18"),
    (b'{"prompt": "\xff"}', "invalid UTF-8 at byte 12"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
]


async def test_the_proxys_own_refusals_carry_the_header(spec_server) -> None:
    async with run_proxy(spec_server, None, k=2, api_key="k3y", max_body_bytes=2048) as proxy:
        auth = {"Authorization": "Bearer k3y"}
        async with proxy.session.get(proxy.url + "/v1/models") as response:
            assert response.status == 401
            assert response.headers["X-Npu-Spec"] == "proxy"
        body = {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}
        url = proxy.url + "/v1/chat/completions"
        async with proxy.session.post(url, json=body, headers=auth) as response:
            assert response.status == 400
            assert response.headers["X-Npu-Spec"] == "proxy"
        async with proxy.session.post(url, data=b"x" * 4096, headers=auth) as response:
            assert response.status == 413
            assert response.headers["X-Npu-Spec"] == "proxy"
        # what llama-server served keeps its own value
        async with proxy.session.get(proxy.url + "/v1/models", headers=auth) as response:
            assert response.status == 200
            assert response.headers["X-Npu-Spec"] == "passthrough"


async def test_health_and_metrics_are_the_proxys_own(http, spec_server) -> None:
    async with run_proxy(spec_server, None, k=2, api_key="k3y") as proxy:
        for path in ("/health", "/v1/health"):
            async with http.get(spec_server + path) as response:
                expected = response.status, await response.read()
            async with proxy.session.get(proxy.url + path) as response:  # public: no key
                assert response.headers["X-Npu-Spec"] == "proxy", path
                # health checks read it as they read llama-server's
                assert (response.status, await response.read()) == expected == (200, expected[1])
        auth = {"Authorization": "Bearer k3y"}
        async with proxy.session.get(proxy.url + "/metrics", headers=auth) as response:
            assert response.status == 200
            assert response.headers["X-Npu-Spec"] == "proxy"
            assert "npu_spec_requests_total" in await response.text()


async def test_health_says_when_llama_server_is_gone(start_server, demo_models) -> None:
    server = await start_server(demo_models / "target.gguf", ["-np", "3"], ctx=512)
    async with run_proxy(server.base_url, None, k=2) as proxy:
        await server.stop()
        async with proxy.session.get(proxy.url + "/health") as response:
            assert response.status == 503
            assert response.headers["X-Npu-Spec"] == "proxy"
            error = (await response.json())["error"]
            assert error["type"] == "unavailable_error" and server.base_url in error["message"]


async def test_a_body_that_is_not_json_is_refused_by_the_proxy(
    spec_server, reference_drafter
) -> None:
    headers = {"Content-Type": "application/json"}
    async with run_proxy(spec_server, reference_drafter, 2) as proxy:
        for path in ("/v1/chat/completions", "/completion", "/tokenize"):
            for body, why in NOT_JSON:
                url = proxy.url + path
                async with proxy.session.post(url, data=body, headers=headers) as response:
                    assert response.status == 400, (path, why)
                    assert response.headers["X-Npu-Spec"] == "proxy"
                    payload = await response.json()
                assert payload == {
                    "error": {
                        "code": 400,
                        "message": f"request body is not valid JSON: {why}",
                        "type": "invalid_request_error",
                    }
                }, path
        assert proxy.state.metrics.requests["passthrough"] == 0  # none reached the server
