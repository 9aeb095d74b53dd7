"""Every answer says who served it: X-Npu-Spec is on the proxy's own refusals too."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import run_proxy

pytestmark = [pytest.mark.server]


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
        # what either path served keeps its own value
        async with proxy.session.get(proxy.url + "/health") as response:
            assert response.status == 200
            assert response.headers["X-Npu-Spec"] == "passthrough"
        async with proxy.session.get(proxy.url + "/v1/models", headers=auth) as response:
            assert response.status == 200
            assert response.headers["X-Npu-Spec"] == "passthrough"
