"""Client for one unmodified llama-server: the only module that speaks its HTTP API.

Every call goes through one keep-alive connection pool and has a timeout. Transport
failures and 5xx answers raise `UpstreamError`, which the API turns into a 502/503
that names the upstream and the reason; a 4xx answer from the server is a client
error and comes back as `UpstreamClientError` carrying the server's own JSON body.
A request the server never answered (the connection it went out on was closed or
reset first) is sent once more on a new connection: `UpstreamClient.request`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.data.sampling import SamplingSpec
from proxy.data.verify import PlainRun, VerifyResult
from proxy.server.prompt_json import ContextTextCache, verify_body_text

# Keys the verify batch needs back from each result; everything else is trimmed. The
# server's own timings split a round's wall time into server compute and the rest.
VERIFY_FIELDS = [
    "index", "tokens", "content", "stop_type", "timings/cache_n", "id_slot",
    "timings/prompt_n", "timings/prompt_ms", "timings/predicted_ms",
]  # fmt: skip

# The greedy sampler chain: top_k = 1 keeps only the argmax, exactly what the server
# picks at temperature 0 with its default chain.
GREEDY_VERIFY_PARAMS: dict[str, Any] = {
    "n_predict": 1,
    "cache_prompt": True,
    "return_tokens": True,
    "temperature": 0.0,
    "top_k": 1,
    "samplers": ["top_k"],
    "stream": False,
    "response_fields": VERIFY_FIELDS,
}


# Sampling verification (docs/CLIENTS.md, "Sampling"): the request's own chain, every other sampler
# left out, and n_probs >= top_k with post_sampling_probs, so each result carries the
# whole distribution the server samples from (top_k bounds its support).
SAMPLING_CHAIN = ["top_k", "top_p", "min_p", "temperature"]  # llama.cpp's default order


def sampling_verify_params(spec: SamplingSpec, seed: int) -> dict[str, Any]:
    chain = spec.chain
    return {
        "n_predict": 1,
        "cache_prompt": True,
        "return_tokens": True,
        "temperature": chain.temperature,
        "top_k": chain.top_k,
        "top_p": chain.top_p,
        "min_p": chain.min_p,
        "min_keep": spec.min_keep,
        "samplers": SAMPLING_CHAIN,
        "n_probs": chain.top_k,
        "post_sampling_probs": True,
        "backend_sampling": False,
        "seed": seed,  # the server's own draw is used for partial-UTF-8 positions
        "stream": False,
        "response_fields": [*VERIFY_FIELDS, "completion_probabilities"],
    }


KEEPALIVE_TIMEOUT_S = 4.0  # below cpp-httplib's 5 s server-side keep-alive

log = logging.getLogger(__name__)
_DROPPED = (
    aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError
)  # fmt: skip


def unanswered(exc: BaseException) -> bool:
    """Whether a request failed before the server answered anything because the
    connection it went out on was closed or reset: a pooled keep-alive connection
    llama-server had just dropped. aiohttp says so as `ServerDisconnectedError` (the
    close came while waiting for the answer), as `ClientOSError` "Can not write
    request body" (it came between the request's head and its body) or as a reset
    (ECONNRESET, EPIPE). Not a refused connection (the server is not there), not a
    timeout, not a bad answer."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, _DROPPED)


class UpstreamError(Exception):
    """llama-server could not be reached or failed; maps to 502 (bad answer) or 503."""

    def __init__(self, base_url: str, reason: str, status: int = 502) -> None:
        super().__init__(f"upstream llama-server at {base_url}: {reason}")
        self.base_url = base_url
        self.reason = reason
        self.status = status


class UpstreamClientError(Exception):
    """llama-server refused the request (4xx); `body` is its JSON error, passed on as is."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        super().__init__(f"llama-server answered {status}: {message}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class RawJson:
    """A request body already encoded as JSON text."""

    text: str


# A plain run is the greedy verify request with more tokens: same sampler chain, so
# its tokens are what llama-server alone writes at temperature 0.
PLAIN_RUN_FIELDS = [
    "tokens", "content", "stop_type", "timings/cache_n", "id_slot", "timings/prompt_ms",
    "timings/predicted_ms",
]  # fmt: skip


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    control: float = 30.0  # props, tokenize, metrics, ...
    verify: float = 600.0  # a first round may prefill a long prompt on a slow CPU


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page by name, labels included as written:
    'name' or 'name{position="0"}' (the project's one parser; proxy.bench uses it)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line)
        if match:
            try:
                values[match.group(1)] = float(match.group(2))
            except ValueError:
                continue
    return values


class UpstreamClient:
    def __init__(
        self,
        base_url: str,
        timeouts: Timeouts | None = None,
        pool_size: int = 64,
        api_key: str | None = None,
        backend_sampling: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # greedy verify rounds and plain runs: with `backend_sampling` the server picks
        # the argmax on the device (no logits copied to the host, no sampling there one
        # prompt after another); llama-server alone samples on the host, the same argmax
        self._greedy_params = (
            {**GREEDY_VERIFY_PARAMS, "backend_sampling": True}
            if backend_sampling
            else GREEDY_VERIFY_PARAMS
        )
        self.timeouts = timeouts or Timeouts()
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None  # for second attempts
        # llama-server's --api-key; sent on every request, never logged
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._contexts = ContextTextCache()  # JSON text of recent verify contexts

    # -- lifecycle ---------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # llama-server (cpp-httplib) closes a connection idle for 5 s; keeping ours
            # for less means a pooled connection is not reused just as the server drops it.
            connector = aiohttp.TCPConnector(
                limit=self._pool_size, keepalive_timeout=KEEPALIVE_TIMEOUT_S
            )
            self._session = self._new_session(connector)
        return self._session

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        # auto_decompress off: pass-through must hand bodies on byte for byte.
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            raise_for_status=False,
            headers=self._headers,
        )

    async def request(self, method: str, path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """Send one request; returns once the answer's head is in (the caller reads the
        body and releases the response: `async with`). A request the server never
        answered (`unanswered`) is sent once more, on a new connection, so it cannot
        meet a second dropped one from the pool; nothing came back the first time, so
        nothing can have reached a client. The second attempt's failure is raised."""
        url = self.base_url + path
        try:
            return await self.session.request(method, url, **kwargs)
        except aiohttp.ClientError as exc:
            if not unanswered(exc):
                raise
            log.info("%s %s: %r before any answer; sent again on a new connection",
                     method, path, exc)  # fmt: skip
        if self._fresh_session is None or self._fresh_session.closed:
            self._fresh_session = self._new_session(aiohttp.TCPConnector(force_close=True))
        return await self._fresh_session.request(method, url, **kwargs)

    async def close(self) -> None:
        for session in (self._session, self._fresh_session):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._fresh_session = None

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- plumbing ----------------------------------------------------------------

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=self.timeouts.connect)

    async def _send(
        self, method: str, path: str, data: Any, headers: dict[str, str] | None, timeout: float
    ) -> tuple[int, bytes]:
        """One request and its whole answer (sent again once where the server never
        answered: `request`). Every call the proxy makes here is safe to repeat
        (tokenize, verify, slot actions, metrics)."""
        response = await self.request(
            method, path, data=data, headers=headers, timeout=self._timeout(timeout)
        )
        async with response:
            return response.status, await response.read()

    async def _request_json(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> Any:
        data = _encoded(body)
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            status, raw = await self._send(
                method, path, data, headers, timeout or self.timeouts.control
            )
        except TimeoutError as exc:
            raise UpstreamError(self.base_url, f"{method} {path} timed out", 504) from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(self.base_url, f"cannot connect ({exc.os_error})", 503) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(self.base_url, f"{method} {path} failed: {exc!r}", 502) from exc
        try:
            payload = json.loads(raw) if raw else None
        except ValueError as exc:
            raise UpstreamError(
                self.base_url, f"{method} {path} returned non-JSON (HTTP {status})"
            ) from exc
        if status == 503:
            message = _error_message(payload) or "unavailable"
            raise UpstreamError(self.base_url, f"{method} {path}: {message}", 503)
        if 400 <= status < 500:
            raise UpstreamClientError(status, payload if isinstance(payload, dict) else {})
        if status >= 500:
            message = _error_message(payload) or f"HTTP {status}"
            raise UpstreamError(self.base_url, f"{method} {path}: {message}", 502)
        return payload

    # -- endpoints ---------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        return await self._request_json("GET", "/health")

    async def props(self) -> dict[str, Any]:
        return await self._request_json("GET", "/props")

    async def models(self) -> dict[str, Any]:
        return await self._request_json("GET", "/v1/models")

    async def slots(self) -> list[dict[str, Any]]:
        return await self._request_json("GET", "/slots")

    async def slot_action(self, id_slot: int, action: str, filename: str) -> dict[str, Any]:
        """`/slots/{id}?action=save|restore` (needs --slot-save-path on the server)."""
        return await self._request_json(
            "POST", f"/slots/{int(id_slot)}?action={action}", {"filename": filename}
        )

    async def metrics_text(self) -> str:
        try:
            status, raw = await self._send("GET", "/metrics", None, None, self.timeouts.control)
        except TimeoutError as exc:
            raise UpstreamError(self.base_url, "GET /metrics timed out", 504) from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(self.base_url, f"cannot connect ({exc.os_error})", 503) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(self.base_url, f"GET /metrics failed: {exc!r}", 502) from exc
        if status != 200:
            raise UpstreamError(
                self.base_url,
                f"GET /metrics: HTTP {status} (start llama-server with --metrics)",
                502,
            )
        return raw.decode("utf-8", errors="replace")

    async def metrics(self) -> dict[str, float]:
        return parse_prometheus(await self.metrics_text())

    async def n_decode_total(self) -> int:
        values = await self.metrics()
        if "llamacpp:n_decode_total" not in values:
            raise UpstreamError(self.base_url, "no llamacpp:n_decode_total in /metrics", 502)
        return int(values["llamacpp:n_decode_total"])

    async def tokenize(
        self,
        content: str | Sequence[str | int],
        add_special: bool = False,
        parse_special: bool = True,
    ) -> list[int]:
        body = {"content": content, "add_special": add_special, "parse_special": parse_special}
        payload = await self._request_json("POST", "/tokenize", body)
        return [int(t) for t in payload["tokens"]]

    async def token_bytes(self, token: int) -> bytes:
        """Exact bytes of one token's piece (the server sends invalid UTF-8 as a byte list)."""
        return (await self.tokens_bytes([token]))[0]

    async def tokens_bytes(self, tokens: Sequence[int]) -> list[bytes]:
        """Exact bytes of each token's piece, in one request."""
        body = {"content": [int(t) for t in tokens], "with_pieces": True}
        payload = await self._request_json("POST", "/tokenize", body)
        entries = payload["tokens"]
        if len(entries) != len(tokens):
            raise UpstreamError(self.base_url, "/tokenize returned a piece count that differs")
        return [
            e["piece"].encode("utf-8") if isinstance(e["piece"], str) else bytes(e["piece"])
            for e in entries
        ]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        payload = await self._request_json("POST", "/detokenize", {"tokens": list(tokens)})
        return payload["content"]

    async def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt text the server itself builds for an OpenAI chat request."""
        payload = await self._request_json("POST", "/apply-template", body)
        return payload["prompt"]

    async def completion(self, body: dict[str, Any]) -> Any:
        """A plain `/completion` call (non-streaming), for probes."""
        return await self._request_json("POST", "/completion", body, timeout=self.timeouts.verify)

    async def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token id: `ignore_eos` makes the server list them
        all as -inf logit biases in the generation settings it reports."""
        body = {
            "prompt": [0],
            "n_predict": 1,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "response_fields": ["generation_settings/logit_bias"],
        }
        payload = await self.completion(body)
        biases = payload.get("generation_settings/logit_bias") or []
        return frozenset(int(b["token"]) for b in biases if isinstance(b, dict) and "token" in b)

    async def verify(
        self,
        context: Sequence[int],
        draft: Sequence[int],
        sampling: SamplingSpec | None = None,
        seed: int = 0,
        pad: Sequence[int] = (),
    ) -> list[VerifyResult]:
        """Score `draft` after `context` in one batched pass: one `/completion` of k+1 prompts.

        Returns k+1 results: result i is the target's next token after
        context + draft[:i] (greedy, or with `sampling` its own draw with `seed` plus
        the full post-sampling distribution). No `id_slot`, no `n_cmpl`: each prompt
        must pick the idle slot sharing its longest prefix. `pad`: one more prompt, last
        in the batch, whose result comes last (`proxy.engine.round_shape`).
        """
        params = self._greedy_params if sampling is None else sampling_verify_params(sampling, seed)
        body = RawJson(verify_body_text(self._contexts.text(list(context)), draft, params, pad))
        payload = await self._request_json(
            "POST", "/completion", body, timeout=self.timeouts.verify
        )
        results = payload if isinstance(payload, list) else [payload]
        n_prompts = len(draft) + 1 + (1 if pad else 0)
        if len(results) != n_prompts:
            raise UpstreamError(
                self.base_url,
                f"verify batch of {n_prompts} prompts returned {len(results)} results",
            )
        by_index = sorted(results, key=lambda r: r.get("index", 0))
        out: list[VerifyResult] = []
        for result in by_index:
            tokens = result.get("tokens") or []
            if len(tokens) != 1:
                raise UpstreamError(
                    self.base_url, f"verify result without exactly one token: {result!r}"
                )
            out.append(
                VerifyResult(
                    token=int(tokens[0]),
                    piece=result.get("content", ""),
                    is_eog=result.get("stop_type") == "eos",
                    cached=int(result.get("timings/cache_n", 0)),
                    id_slot=int(result.get("id_slot", -1)),
                    prompt_n=int(result.get("timings/prompt_n", 0)),
                    server_ms=_server_ms(result),
                    candidates=None if sampling is None else parse_candidates(result),
                )
            )
        return out

    async def plain_run(
        self,
        context: Sequence[int],
        n_predict: int,
        sampling: SamplingSpec | None = None,
        seed: int = 0,
    ) -> PlainRun:
        """Up to `n_predict` tokens after `context`, decoded by the server alone: greedy,
        or with `sampling` the request's own chain and `seed` (non-streamed: a streamed
        chunk carries no id for a token that ends inside a UTF-8 character)."""
        if sampling is None:
            params = dict(self._greedy_params)
        else:  # the verify chain without the distribution it reports back
            params = sampling_verify_params(sampling, seed)
            del params["n_probs"], params["post_sampling_probs"]
        params.update(n_predict=n_predict, response_fields=PLAIN_RUN_FIELDS)
        body = RawJson(verify_body_text(self._contexts.text(list(context)), [], params))
        payload = await self._request_json(
            "POST", "/completion", body, timeout=self.timeouts.verify
        )
        result = payload[0] if isinstance(payload, list) and len(payload) == 1 else payload
        tokens = result.get("tokens") if isinstance(result, dict) else None
        if not isinstance(tokens, list) or not tokens or len(tokens) > n_predict:
            raise UpstreamError(self.base_url, f"plain run returned no usable tokens: {result!r}")
        return PlainRun(
            tokens=[int(t) for t in tokens],
            content=str(result.get("content", "")),
            stop_type=str(result.get("stop_type", "")),
            cached=int(result.get("timings/cache_n", 0)),
            id_slot=int(result.get("id_slot", -1)),
            server_ms=_server_ms(result),
        )


def _server_ms(result: dict[str, Any]) -> float:
    """A result's time inside the server: its prompt's ms and its predicted tokens' ms."""
    return float(result.get("timings/prompt_ms", 0.0)) + float(
        result.get("timings/predicted_ms", 0.0)
    )


def parse_candidates(result: dict[str, Any]) -> tuple[tuple[int, bytes, float], ...] | None:
    """The post-sampling candidates of a one-token result, None if it has none."""
    probs = result.get("completion_probabilities") or []
    if not probs:
        return None
    top = probs[0].get("top_probs") or []
    if not top:
        return None
    return tuple((int(c["id"]), bytes(c["bytes"]), float(c["prob"])) for c in top)


def _error_message(payload: Any) -> str | None:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return error.get("message")
        if isinstance(error, str):
            return error
    return None


def _encoded(body: Any) -> str | None:
    if body is None:
        return None
    return body.text if isinstance(body, RawJson) else json.dumps(body)
