"""`make_models`: a deterministic, offline set of target and draft models.

OUT/
  target.gguf     the target for llama-server (core function, padded to a shape's cost)
  core.gguf       the unpadded core as GGUF (only when the target is padded)
  draft.gguf      the draft, for llama.cpp's own drafting in A/B runs (the core draft
                  function, padded to the draft shape's cost)
  draft-core.gguf the unpadded core draft as float32 GGUF (only when the draft is padded)
  target-hf/      the core function as a Hugging Face folder (what the target computes)
  draft-hf/       the core draft function as a Hugging Face folder (what the draft computes)
  draft/          the drafter folder `npu-spec serve --drafter` takes, exported from the
                  draft padded to the draft shape (a temporary padded HF folder)
  manifest.json   how it was made
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from npu_draft.factory.gguf_out import (
    EOS_TOKEN_ID,
    read_tokenizer_fields,
    tensor_weight_type,
    weight_type_name,
    write_gguf,
)
from npu_draft.factory.hf_out import (
    build_tokenizer_files,
    write_hf_folder,
    write_hf_folder_streamed,
)
from npu_draft.factory.quant import dequantize, quantize
from npu_draft.factory.shapes import (
    CORE,
    DRAFT_SHAPES,
    TARGET_SHAPES,
    ModelShape,
    default_draft_shape,
)
from npu_draft.factory.weights import (
    TensorSpec,
    Weights,
    noisy_weights,
    padded_tensors,
    plain_tensors,
    random_weights,
)

log = logging.getLogger(__name__)

DEFAULT_NOISE_SIGMA = 0.05
UNRELATED_SEED_OFFSET = 7919
NOISE_SEED_OFFSET = 104729
FACTORY_DRAFTER_CONTEXT = 8192


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "same" | "noisy" | "unrelated"
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> DraftSpec:
        kind, _, arg = text.partition(":")
        if kind == "same" and not arg:
            return cls("same")
        if kind == "unrelated" and not arg:
            return cls("unrelated")
        if kind == "noisy":
            try:
                sigma = float(arg) if arg else DEFAULT_NOISE_SIGMA
            except ValueError:
                raise ValueError(f"bad noise level in draft spec {text!r}") from None
            if not 0 < sigma < 10:
                raise ValueError(f"noise level must be in (0, 10), got {sigma}")
            return cls("noisy", sigma)
        raise ValueError(f"unknown draft spec {text!r}; use same, noisy[:sigma] or unrelated")

    def __str__(self) -> str:
        return f"noisy:{self.sigma:g}" if self.kind == "noisy" else self.kind


def draft_weights(core: Weights, spec: DraftSpec, seed: int) -> Weights:
    if spec.kind == "same":
        return core
    if spec.kind == "noisy":
        return noisy_weights(core, spec.sigma, seed + NOISE_SEED_OFFSET)
    return random_weights(CORE, seed + UNRELATED_SEED_OFFSET)


def _pinned_sources() -> tuple[Path, str]:
    """llama.cpp's Qwen2 vocab GGUF and the Qwen3 chat template, from the pinned source."""
    from npu_draft import llama_source  # the pinned llama.cpp source, in the npu-spec cache

    llama_source.fetch_source()
    return llama_source.vocab_file(), llama_source.chat_template_file().read_text()


def _tokenizer_dir(vocab_gguf: Path, chat_template: str) -> Path:
    """Tokenizer files converted once per machine and reused."""
    from npu_draft import llama_source

    cached = llama_source.cache_root() / "tokenizer-qwen3"
    if not (cached / "tokenizer.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            build_tokenizer_files(vocab_gguf, chat_template, Path(tmp))
            shutil.rmtree(cached, ignore_errors=True)
            Path(tmp).rename(cached)
            Path(tmp).mkdir()  # let TemporaryDirectory clean up a folder that exists
    return cached


def _weight_type(target_dtype: str | None, big: ModelShape) -> str:
    # Big GPU shapes in float16 (what a real checkpoint would be); small ones exact in float32.
    return weight_type_name(target_dtype or ("float16" if big.hidden >= 2048 else "float32"))


def _draft_weight_type(draft_dtype: str | None, draft_shape: str) -> str:
    # The Qwen3 draft shapes in Q8_0 (what users run a 0.6B draft as); CI's exactly float32.
    default = "q8_0" if draft_shape.startswith("qwen3-") else "float32"
    return weight_type_name(draft_dtype or default)


def _tensors(
    weights: Weights, big: ModelShape, weight_type: str, seed: int
) -> Iterator[TensorSpec]:
    """The model's tensors in `big`'s shape (padded unless it is the core)."""
    # Arrays the tensors are made in: Q8_0 and Q4_0 quantize float32 values.
    dtype = np.dtype(np.float32 if weight_type in ("q8_0", "q4_0") else weight_type)
    if big == CORE:
        return plain_tensors(weights, dtype)
    return padded_tensors(weights, CORE, big, seed, dtype)


def stored_function_weights(core: Weights, weight_type: str) -> Weights:
    """The float32 weights a GGUF of `weight_type` made from `core` really computes with.

    For float32 and float16 that is the core itself (float16 rounding is negligible);
    for q8_0 and q4_0 it is the core quantized and dequantized as the GGUF stores it.
    Drafts are made from the target's, so a `same` draft is the quantized target's own
    function (a Q4_0 target agrees with the float core on only ~30-40% of
    teacher-forced greedy tokens, with its dequantized core on ~95%); and draft-hf/
    and draft/ hold the draft's, so the proxy's drafter drafts what draft.gguf drafts.
    """
    if weight_type not in ("q8_0", "q4_0"):
        return core
    out: Weights = {}
    for name, tensor in core.items():
        kind = tensor_weight_type(name, tensor.shape, weight_type)
        if kind in ("q8_0", "q4_0"):
            out[name] = dequantize(quantize(tensor, kind), kind, tensor.shape)
        else:
            out[name] = tensor
    return out


def _core_weights(seed: int, eos_boost: float) -> Weights:
    core = random_weights(CORE, seed)
    if eos_boost > 0:
        core["lm_head.weight"][EOS_TOKEN_ID] *= eos_boost
    return core


def _write_target(
    path: Path, core: Weights, target_shape: str, weight_type: str, seed: int, common: dict
) -> None:
    big = TARGET_SHAPES[target_shape]
    name = "npu-spec-core" if big == CORE else f"npu-spec-{target_shape}"
    write_gguf(path, big, _tensors(core, big, weight_type, seed), weight_type, name=name, **common)


def _write_unpadded(path: Path, weights: Weights, padded: bool, name: str, common: dict) -> None:
    """The unpadded core of a padded model as float32 GGUF; no file when nothing is padded."""
    if padded:
        write_gguf(path, CORE, plain_tensors(weights, np.float32), np.float32,
                   name=name, **common)  # fmt: skip
    else:
        path.unlink(missing_ok=True)


def _gguf_common(vocab_gguf: Path, chat_template: str, tokenizer_dir: Path) -> dict:
    """The tokenizer and chat template every GGUF of the set carries."""
    fields = read_tokenizer_fields(
        vocab_gguf, cache_file=tokenizer_dir / "gguf-tokenizer-fields.json"
    )
    return {"tokenizer_fields": fields, "chat_template": chat_template}


def _target_shape(name: str) -> ModelShape:
    if name not in TARGET_SHAPES:
        raise ValueError(f"unknown target shape {name!r}; one of {sorted(TARGET_SHAPES)}")
    return TARGET_SHAPES[name]


def write_target(
    path: str | Path,
    seed: int = 0,
    target_shape: str = "small",
    target_dtype: str | None = None,
    eos_boost: float = 0.0,
) -> Path:
    """Only the target GGUF that `make_models` writes for these arguments (same bytes).

    For comparing target weight types without the rest of the set (HF folders, drafter).
    """
    path = Path(path)
    weight_type = _weight_type(target_dtype, _target_shape(target_shape))
    vocab_gguf, chat_template = _pinned_sources()
    tokenizer_dir = _tokenizer_dir(vocab_gguf, chat_template)
    common = _gguf_common(vocab_gguf, chat_template, tokenizer_dir)
    _write_target(path, _core_weights(seed, eos_boost), target_shape, weight_type, seed, common)
    return path


@dataclass(frozen=True)
class ModelSetPlan:
    """The shapes and weight types of one model set, resolved from make_models' arguments."""

    seed: int
    spec: DraftSpec
    target_shape: str
    big: ModelShape
    weight_type: str
    draft_shape: str
    draft_big: ModelShape
    draft_type: str
    eos_boost: float

    @classmethod
    def resolve(
        cls,
        seed: int,
        draft: str | DraftSpec,
        target_shape: str,
        target_dtype: str | None,
        eos_boost: float,
        draft_shape: str | None,
        draft_dtype: str | None,
    ) -> ModelSetPlan:
        spec = draft if isinstance(draft, DraftSpec) else DraftSpec.parse(draft)
        big = _target_shape(target_shape)
        weight_type = _weight_type(target_dtype, big)
        draft_shape = draft_shape or default_draft_shape(target_shape)
        if draft_shape not in DRAFT_SHAPES:
            raise ValueError(f"unknown draft shape {draft_shape!r}; one of {sorted(DRAFT_SHAPES)}")
        return cls(
            seed=seed,
            spec=spec,
            target_shape=target_shape,
            big=big,
            weight_type=weight_type,
            draft_shape=draft_shape,
            draft_big=DRAFT_SHAPES[draft_shape],
            draft_type=_draft_weight_type(draft_dtype, draft_shape),
            eos_boost=eos_boost,
        )

    @property
    def draft_name(self) -> str:
        padded = "" if self.draft_big == CORE else f"-{self.draft_shape}"
        return f"npu-spec-draft-{self.spec}{padded}"

    def manifest(self) -> dict:
        drafted_from_core = self.weight_type not in ("q8_0", "q4_0")
        return {
            "seed": self.seed,
            "draft": str(self.spec),
            "target_shape": self.target_shape,
            "target_dims": asdict(self.big),
            "core_dims": asdict(CORE),
            "target_dtype": self.weight_type,
            "draft_shape": self.draft_shape,
            "draft_dims": asdict(self.draft_big),
            "draft_dtype": self.draft_type,
            "draft_base": (
                "core" if drafted_from_core else f"core as {self.weight_type} (dequantized)"
            ),
            "eos_boost": self.eos_boost,
        }


def make_models(
    out: str | Path,
    seed: int = 0,
    draft: str | DraftSpec = "same",
    target_shape: str = "small",
    target_dtype: str | None = None,
    with_drafter: bool = True,
    eos_boost: float = 0.0,
    draft_shape: str | None = None,
    draft_dtype: str | None = None,
) -> Path:
    """Write the model set into `out` and return it.

    target_dtype is the target's 2-D weight type: float32, float16, q8_0 or q4_0
    (default float16 for the qwen3-* shapes, else float32). q8_0 and q4_0 (GGML
    Q8_0/Q4_0 as llama-quantize writes them; norms stay float32) shrink the file, but
    the quantized core no longer computes the float32 core function exactly (see
    `npu-spec make-models -h`).

    draft_shape pads the draft the way the target is padded (default: qwen3-0.6b for
    the qwen3-* targets, else core); draft_dtype is draft.gguf's weight type (default
    q8_0 for the qwen3-* draft shapes, else float32). draft-hf/ stays the core draft
    function (as draft.gguf stores it: dequantized for q8_0); draft/ is exported from
    it padded, in float32. With a q8_0 or q4_0 target, drafts are made from the
    quantized core (`stored_function_weights`).

    eos_boost > 0 scales the output row of `<|im_end|>` by that factor, so greedy
    generations end by EOS after a few dozen tokens (2.5 ends the test prompts after
    12-30 tokens); the random model otherwise practically never emits it.
    """
    out = Path(out)
    plan = ModelSetPlan.resolve(
        seed, draft, target_shape, target_dtype, eos_boost, draft_shape, draft_dtype
    )
    vocab_gguf, chat_template = _pinned_sources()
    tokenizer_dir = _tokenizer_dir(vocab_gguf, chat_template)
    out.mkdir(parents=True, exist_ok=True)

    core = _core_weights(seed, eos_boost)
    drafted = draft_weights(stored_function_weights(core, plan.weight_type), plan.spec, seed)
    # What draft.gguf computes: draft-hf/, draft-core.gguf and draft/ hold exactly that.
    draft_function = stored_function_weights(drafted, plan.draft_type)
    log.info(
        "writing %s (target %s, draft %s shaped %s, seed %d)",
        out, target_shape, plan.spec, plan.draft_shape, seed,
    )  # fmt: skip
    write_hf_folder(out / "target-hf", CORE, core, tokenizer_dir, f"npu-spec-core-s{seed}")
    draft_hf_name = f"npu-spec-draft-{plan.spec}-s{seed}"
    write_hf_folder(out / "draft-hf", CORE, draft_function, tokenizer_dir, draft_hf_name)
    common = _gguf_common(vocab_gguf, chat_template, tokenizer_dir)
    _write_ggufs(out, plan, core, drafted, draft_function, common)
    if with_drafter:
        _export_draft(out, draft_function, plan.draft_big, plan.draft_name, tokenizer_dir, seed)
    (out / "manifest.json").write_text(json.dumps(plan.manifest(), indent=2) + "\n")
    return out


def _write_ggufs(
    out: Path,
    plan: ModelSetPlan,
    core: Weights,
    drafted: Weights,
    draft_function: Weights,
    common: dict,
) -> None:
    """target.gguf, draft.gguf and, where they are padded, their unpadded cores."""
    _write_target(out / "target.gguf", core, plan.target_shape, plan.weight_type, plan.seed, common)
    _write_unpadded(out / "core.gguf", core, plan.big != CORE, "npu-spec-core", common)
    draft_tensors = _tensors(drafted, plan.draft_big, plan.draft_type, plan.seed)
    write_gguf(out / "draft.gguf", plan.draft_big, draft_tensors, plan.draft_type,
               name=plan.draft_name, **common)  # fmt: skip
    _write_unpadded(out / "draft-core.gguf", draft_function, plan.draft_big != CORE,
                    f"npu-spec-draft-{plan.spec}", common)  # fmt: skip


def _export_draft(
    out: Path, drafted: Weights, draft_big: ModelShape, name: str, tokenizer_dir: Path, seed: int
) -> None:
    """draft/ from the draft padded to `draft_big` (from draft-hf/ when it is the core)."""
    from npu_draft.onnx_writer import write_drafter  # the builder's graph, without PyTorch

    # 8k so benchmark prompts of 4k tokens plus their answers can still be drafted.
    if draft_big == CORE:
        write_drafter(out / "draft-hf", out / "draft", max_context=FACTORY_DRAFTER_CONTEXT)
        return
    # The padded float32 source (3 GB for qwen3-0.6b) lives only as long as the export.
    with tempfile.TemporaryDirectory(dir=out, prefix=".draft-padded-hf-") as tmp:
        source = Path(tmp) / "hf"
        tensors = padded_tensors(drafted, CORE, draft_big, seed, np.dtype(np.float32))
        write_hf_folder_streamed(source, draft_big, tensors, tokenizer_dir, name)
        write_drafter(source, out / "draft", max_context=FACTORY_DRAFTER_CONTEXT)
