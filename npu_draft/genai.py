"""Backend `genai`: ONNX Runtime GenAI model folders (genai_config.json + model.onnx).

This is the format of AMD's Ryzen AI NPU models. onnxruntime-genai 0.18.0 returns
silently wrong results in two patterns, and this backend never uses either:

- reading logits (or generating) straight after `rewind_to`: every rewind here is
  followed by an `append_tokens` of at least one token before logits are read;
- `append_tokens` straight after `generate_next_token` (the generated token never
  enters the cache): `generate_next_token` is never called; tokens are chosen from
  `get_logits()` here and fed back with `append_tokens`.

Re-sync after a round with common prefix P and new tokens T is the safe form
`rewind_to(len(P) - 1)` then `append_tokens([P[-1], *T])`: one token more than
strictly needed, always O(new tokens).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from npu_draft import providers
from npu_draft.onnx_runner import DEFAULT_MAX_CONTEXT, folder_max_context
from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DrafterInfo,
    SamplingParams,
    SyncStats,
    common_prefix_length,
)
from npu_draft.sampling import draft_next
from npu_draft.tokenizer_check import drafter_facts

log = logging.getLogger(__name__)


# genai_config.json provider names -> ours
_GENAI_TO_OURS = {"vitisai": "npu", "ryzenai": "npu", "cuda": "cuda", "cpu": "cpu"}
_OURS_TO_GENAI = {"npu": "VitisAI", "cuda": "cuda"}


def _import_genai():
    import onnxruntime  # noqa: F401  # genai dlopens the library this package ships
    import onnxruntime_genai

    return onnxruntime_genai


def configured_provider(folder: Path) -> str:
    """Our name of the first provider genai_config.json asks for ("cpu" if none)."""
    config = json.loads((folder / "genai_config.json").read_text())
    options = config["model"]["decoder"].get("session_options", {}).get("provider_options", [])
    for entry in options:
        for name in entry:
            return _GENAI_TO_OURS.get(name.lower(), name.lower())
    return "cpu"


class GenaiDraftModel:
    def __init__(
        self,
        folder: str | Path,
        provider: str = "auto",
        *,
        max_context: int | None = None,
        threads: int | None = None,
        cross_check: bool | None = None,
        config_file: str | None = None,
        cache_dir: str | None = None,
        cache_key: str | None = None,
    ) -> None:
        og = _import_genai()
        self.folder = Path(folder)
        config_json = json.loads((self.folder / "genai_config.json").read_text())["model"]
        vitisai = {"config_file": config_file, "cache_dir": cache_dir, "cache_key": cache_key}
        self.choice = self._resolve_provider(provider, vitisai)
        self._og = og
        self.threads = threads or providers.default_threads()
        self.model = og.Model(self._config(self.choice))
        declared = config_json.get("context_length", DEFAULT_MAX_CONTEXT)
        self.max_context = min(max_context or folder_max_context(self.folder, declared), declared)
        eos = config_json.get("eos_token_id", [])
        facts = drafter_facts(self.folder)
        self.info = DrafterInfo(
            name=facts.name if facts is not None else self.folder.name,
            backend="genai",
            provider=self.choice.name,
            vocab_size=config_json["vocab_size"],
            max_context=self.max_context,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            bos_token_id=config_json.get("bos_token_id"),
            tokenizer_fingerprint=None if facts is None else facts.fingerprint,
        )
        log.info(
            "draft model %s: backend genai on %s, context %d",
            self.info.name,
            self.choice.name,
            self.max_context,
        )
        if cross_check if cross_check is not None else self.choice.name != "cpu":
            providers.cross_check_against_cpu(
                self.choice, self.info.name, self.probe_logits(), self._cpu_probe_logits
            )

    def _resolve_provider(self, requested: str, vitisai: dict) -> providers.ProviderChoice:
        """With "auto", keep what genai_config.json asks for when this machine has it."""
        if requested.lower() == "auto":
            wanted = configured_provider(self.folder)
            if wanted in providers.available_names():
                requested = wanted
            elif wanted != "cpu":
                log.warning(
                    "%s asks for provider %r, which this ONNX Runtime lacks; choosing another",
                    self.folder / "genai_config.json",
                    wanted,
                )
        return providers.choose_provider(requested, **vitisai)

    def _config(self, choice: providers.ProviderChoice):
        config = self._og.Config(str(self.folder))
        threading = {"intra_op_num_threads": self.threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": threading}}}))
        if choice.name == configured_provider(self.folder) and not choice.options:
            return config  # as the folder asks, with its own provider options (Ryzen AI)
        config.clear_providers()
        if choice.name != "cpu":
            genai_name = _OURS_TO_GENAI[choice.name]
            config.append_provider(genai_name)
            for key, value in choice.options.items():
                config.set_provider_option(genai_name, key, value)
        return config

    def open_session(self) -> GenaiDraftSession:
        return GenaiDraftSession(self)

    def probe_logits(self) -> np.ndarray:
        session = self.open_session()
        try:
            session.sync(providers.probe_tokens(self.info.vocab_size or 1))
            return session.next_logits()
        finally:
            session.close()

    def _cpu_probe_logits(self) -> np.ndarray:
        reference = GenaiDraftModel(
            self.folder, "cpu", max_context=64, threads=self.threads, cross_check=False
        )
        try:
            return reference.probe_logits()
        finally:
            reference.close()

    def close(self) -> None:
        self.model = None


class GenaiDraftSession:
    def __init__(self, model: GenaiDraftModel) -> None:
        self._model = model
        self._generator = self._new_generator()
        self._cached: list[int] = []  # tokens appended to the generator
        self._pending: list[int] = []  # drafted, not yet appended
        self._logits: np.ndarray | None = None  # after _cached[-1]

    def _new_generator(self):
        og = self._model._og
        params = og.GeneratorParams(self._model.model)
        params.set_search_options(max_length=self._model.max_context, do_sample=False)
        return og.Generator(self._model.model, params)

    @property
    def tokens(self) -> Sequence[int]:
        return self._cached + self._pending

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        tokens = list(tokens)
        if len(tokens) > self._model.max_context:
            raise ValueError(
                f"sequence of {len(tokens)} tokens exceeds the drafter's context of "
                f"{self._model.max_context}"
            )
        self._pending = []
        common = common_prefix_length(self._cached, tokens)
        if common == len(tokens) == len(self._cached):
            return SyncStats(reused=common, appended=0)
        if common == len(self._cached):  # plain extension: no rewind involved
            keep = common
        elif common == 0:  # nothing shared: a fresh generator is the only safe start
            self._generator = self._new_generator()
            keep = 0
        else:  # the safe re-sync: rewind one further and re-feed the last common token
            keep = common - 1
            self._generator.rewind_to(keep)
        self._cached = tokens[:keep]
        self._logits = None
        if len(tokens) > keep:
            self._append(tokens[keep:])
        return SyncStats(reused=keep, appended=len(tokens) - keep)

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        draft = Draft(dists=None if sampling.greedy else [])
        room = self._model.max_context - len(self._cached) - len(self._pending)
        for _ in range(min(k, room)):
            if cancel is not None and cancel.cancelled:
                break
            token = draft_next(draft, self.next_logits(), sampling, rng)
            self._pending.append(token)
        return draft

    def next_logits(self) -> np.ndarray:
        if self._pending:
            self._append(self._pending)
            self._pending = []
        if self._logits is None:
            raise RuntimeError("no tokens synced yet: call sync() with a non-empty prefix first")
        return self._logits

    def _append(self, new_tokens: Sequence[int]) -> None:
        self._generator.append_tokens(np.asarray(new_tokens, dtype=np.int32))
        self._cached.extend(new_tokens)
        self._logits = self._read_logits()

    def _read_logits(self) -> np.ndarray:
        logits = np.asarray(self._generator.get_logits())
        return np.array(logits.reshape(-1, logits.shape[-1])[-1], dtype=np.float32)

    def close(self) -> None:
        self._generator = None
