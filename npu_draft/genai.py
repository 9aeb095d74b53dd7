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
from typing import Any

import numpy as np

from npu_draft import providers
from npu_draft.ort_backend import (
    DEFAULT_MAX_CONTEXT,
    OrtDraftModel,
    OrtDraftSession,
    session_context,
)
from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    SamplingParams,
    SyncStats,
    common_prefix_length,
)
from npu_draft.sampling import draft_next

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


class GenaiDraftModel(OrtDraftModel):
    backend = "genai"

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
        self.max_context = session_context(self.folder, max_context, declared)
        eos = config_json.get("eos_token_id", [])
        self._describe_and_check(
            vocab_size=config_json["vocab_size"],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            bos_token_id=config_json.get("bos_token_id"),
            cross_check=cross_check,
            runs_on=self.choice.name,
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

    def _cpu_reference_options(self) -> dict[str, Any]:
        return {"threads": self.threads}

    def close(self) -> None:
        self.model = None


class GenaiDraftSession(OrtDraftSession):
    def __init__(self, model: GenaiDraftModel) -> None:
        super().__init__()
        self._model = model
        self._generator = self._new_generator()

    def _new_generator(self):
        og = self._model._og
        params = og.GeneratorParams(self._model.model)
        params.set_search_options(max_length=self._model.max_context, do_sample=False)
        return og.Generator(self._model.model, params)

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        tokens = self._fitting(tokens, self._model.max_context)
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
        return self._keep_and_feed(tokens, keep)

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

    def _feed(self, new_tokens: Sequence[int]) -> None:
        self._generator.append_tokens(np.asarray(new_tokens, dtype=np.int32))
        self._cached.extend(new_tokens)
        self._logits = self._read_logits()

    def _read_logits(self) -> np.ndarray:
        logits = np.asarray(self._generator.get_logits())
        return np.array(logits.reshape(-1, logits.shape[-1])[-1], dtype=np.float32)

    def close(self) -> None:
        self._generator = None
