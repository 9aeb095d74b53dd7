"""What the two ONNX Runtime backends (`onnx`, `genai`) share.

Both load a drafter folder onto a chosen execution provider, size the session's
context, describe themselves in a `DrafterInfo` and, on an accelerator, compare
their first-step logits with a CPU copy of themselves before drafting. Their
sessions keep the same bookkeeping: tokens in the model's cache, drafted tokens not
yet run, and the logits after the last cached token. Each backend keeps only what
differs: how it loads the model and how it runs tokens through it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from npu_draft import providers
from npu_draft.protocol import DrafterInfo, SyncStats
from npu_draft.tokenizer_check import DrafterManifest, drafter_facts

DEFAULT_MAX_CONTEXT = 4096  # Ryzen AI NPU models stop at 4k; the buffer is sized for it
CPU_REFERENCE_CONTEXT = 64  # enough for the probe sequence


def folder_max_context(folder: Path, declared: int) -> int:
    """Longest sequence to size a drafter's KV buffers for, when the caller gives none.

    A folder written by `npu-spec export-drafter` was sized at export (`--max-context`,
    recorded in npu_draft.json); any other folder is capped at 4,096 tokens, the Ryzen
    AI NPU limit, because the buffers are allocated for the whole length up front.
    """
    manifest = DrafterManifest.read(folder)
    if manifest is not None and manifest.decoder.get("context_length"):
        return int(manifest.decoder["context_length"])
    return min(declared, DEFAULT_MAX_CONTEXT)


def session_context(folder: Path, requested: int | None, declared: int) -> int:
    """The context a session holds: what the caller asks (else the folder's), at most
    what the model declares."""
    return min(requested or folder_max_context(folder, declared), declared)


class OrtDraftModel(ABC):
    """A drafter folder loaded into ONNX Runtime; `open_session()` gives each
    conversation its own cache.

    A backend's constructor sets `folder`, `choice` and `max_context`, loads the
    model, then calls `_describe_and_check`.
    """

    backend: ClassVar[str]  # DrafterInfo.backend
    folder: Path
    choice: providers.ProviderChoice
    max_context: int
    info: DrafterInfo

    def _describe_and_check(
        self,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        cross_check: bool | None,
        runs_on: str,
    ) -> None:
        """Set `info`, log where the model runs (`runs_on`), and on an accelerator
        (or when `cross_check` asks) refuse logits that disagree with the CPU's."""
        facts = drafter_facts(self.folder)
        self.info = DrafterInfo(
            name=facts.name if facts is not None else self.folder.name,
            backend=self.backend,
            provider=self.choice.name,
            vocab_size=vocab_size,
            max_context=self.max_context,
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
            tokenizer_fingerprint=None if facts is None else facts.fingerprint,
        )
        # Logged under the backend's module, where the log always came from.
        logging.getLogger(type(self).__module__).info(
            "draft model %s: backend %s on %s, context %d",
            self.info.name,
            self.backend,
            runs_on,
            self.max_context,
        )
        if cross_check if cross_check is not None else self.choice.name != "cpu":
            providers.cross_check_against_cpu(
                self.choice, self.info.name, self.probe_logits(), self._cpu_probe_logits
            )

    @abstractmethod
    def open_session(self) -> OrtDraftSession: ...

    @abstractmethod
    def close(self) -> None: ...

    def probe_logits(self) -> np.ndarray:
        """Logits after a fixed probe sequence, for the start-up provider check."""
        session = self.open_session()
        try:
            session.sync(providers.probe_tokens(self.info.vocab_size or 1))
            return session.next_logits()
        finally:
            session.close()

    def _cpu_reference_options(self) -> dict[str, Any]:
        """Constructor options the CPU copy shares with this model."""
        return {}

    def _cpu_probe_logits(self) -> np.ndarray:
        reference = type(self)(  # type: ignore[call-arg]  # every backend takes these
            self.folder,
            "cpu",
            max_context=CPU_REFERENCE_CONTEXT,
            cross_check=False,
            **self._cpu_reference_options(),
        )
        try:
            return reference.probe_logits()
        finally:
            reference.close()


class OrtDraftSession(ABC):
    """One token sequence's cache: `_cached` tokens are in the model's cache,
    `_pending` ones are drafted after them but not yet run."""

    def __init__(self) -> None:
        self._cached: list[int] = []
        self._pending: list[int] = []
        self._logits: np.ndarray | None = None  # after _cached[-1]

    @abstractmethod
    def _feed(self, new_tokens: Sequence[int]) -> None:
        """Run `new_tokens` after `_cached`, append them to it and set `_logits`."""

    @abstractmethod
    def sync(self, tokens: Sequence[int]) -> SyncStats: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    def tokens(self) -> Sequence[int]:
        return self._cached + self._pending

    @staticmethod
    def _fitting(tokens: Sequence[int], max_context: int) -> list[int]:
        """`tokens` as a list, or ValueError when they exceed the context."""
        tokens = list(tokens)
        if len(tokens) > max_context:
            raise ValueError(
                f"sequence of {len(tokens)} tokens exceeds the drafter's context of {max_context}"
            )
        return tokens

    def _keep_and_feed(self, tokens: list[int], keep: int) -> SyncStats:
        """End a sync: the model's cache holds `tokens[:keep]`; run the rest."""
        self._cached = tokens[:keep]
        self._logits = None
        if len(tokens) > keep:
            self._feed(tokens[keep:])
        return SyncStats(reused=keep, appended=len(tokens) - keep)

    def next_logits(self) -> np.ndarray:
        if self._pending:
            self._feed(self._pending)
            self._pending = []
        if self._logits is None:
            raise RuntimeError("no tokens synced yet: call sync() with a non-empty prefix first")
        return self._logits
