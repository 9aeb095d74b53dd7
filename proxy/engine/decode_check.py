"""The one-decode check: a verify round must cost the server exactly one llama_decode
(a first round may prefill in batches); server flags that break it are named."""

from __future__ import annotations

import logging

from proxy.server.upstream import UpstreamClient

log = logging.getLogger(__name__)


class DecodeCountError(AssertionError):
    """The server did more than one llama_decode for one verify round."""


class DecodeCounter:
    """llama-server's decode and prompt-token counters, read after every round of one
    generation when checking is on."""

    def __init__(
        self, upstream: UpstreamClient, check: bool, strict: bool, request_id: str
    ) -> None:
        self.upstream = upstream
        self.enabled = check or strict
        self.strict = strict
        self.request_id = request_id
        self._last: tuple[int, int] | None = None

    async def start(self) -> None:
        if self.enabled:
            self._last = await self._read()

    async def round_delta(self) -> tuple[int | None, int | None]:
        """(decodes, prompt tokens) since the last reading; (None, None) when off."""
        if self._last is None:
            return None, None
        now = await self._read()
        decodes, prompt_tokens = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return decodes, prompt_tokens

    def check(self, decodes: int | None, round_index: int, catch_up: bool = False) -> None:
        """Warn (strict: raise) where verify round `round_index` took other than one
        decode; the first round (index 0) may prefill in batches, and so may a round
        whose slots catch up (`catch_up`): where a copy costs more than the prefill it
        would spare, they prefill what they lack in it, which past the server's `-b`
        is several decodes. Steady rounds still show a server that splits batches."""
        if decodes is None or decodes == 1 or round_index == 0 or catch_up:
            return
        message = (
            f"[{self.request_id}] round {round_index} took {decodes} server "
            "decodes instead of 1 (check -kvu, --no-cache-idle-slots, -cram 0, -c)"
        )
        if self.strict:
            raise DecodeCountError(message)
        log.warning(message)

    async def _read(self) -> tuple[int, int]:
        """(llamacpp:n_decode_total, llamacpp:prompt_tokens_total) right now."""
        values = await self.upstream.metrics()
        return int(values["llamacpp:n_decode_total"]), int(values["llamacpp:prompt_tokens_total"])
