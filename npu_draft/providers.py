"""Execution-provider choice for the draft model, and the start-up check against CPU.

Names used across the project: "npu" (AMD XDNA through ONNX Runtime's VitisAI
execution provider), "cuda", "cpu", and "auto" (the first of npu, cuda, cpu that this
ONNX Runtime build offers). Asking for "npu" or "cuda" when it is absent is an error at
start-up, never a silent fallback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

ORT_NAMES: dict[str, str] = {
    "npu": "VitisAIExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
AUTO_ORDER = ("npu", "cuda", "cpu")
REQUESTABLE = ("auto", *AUTO_ORDER)

# Our option names -> the VitisAI provider's (Ryzen AI): the compiler configuration
# (vaip_config.json), where compiled models are cached, and the cache entry name.
VITISAI_OPTION_KEYS = {
    "config_file": "config_file",
    "cache_dir": "cacheDir",
    "cache_key": "cacheKey",
}

# First-step logits of an accelerator may differ from CPU by rounding (fp16/bf16
# accumulation on NPUs and GPUs); a wrong graph differs by far more than this.
CROSS_CHECK_ATOL = 5e-2
CROSS_CHECK_RTOL = 5e-2


class ProviderUnavailable(RuntimeError):
    """The requested execution provider is not part of this ONNX Runtime build."""


class ProviderMismatch(RuntimeError):
    """The accelerator's logits disagree with the CPU provider's on the same input."""


@dataclass(frozen=True)
class ProviderChoice:
    name: str  # "npu", "cuda" or "cpu"
    options: dict[str, str] = field(default_factory=dict)

    @property
    def ort_name(self) -> str:
        return ORT_NAMES[self.name]

    def ort_providers(self) -> list[str | tuple[str, dict[str, str]]]:
        """The `providers=` argument for an InferenceSession (CPU stays as fallback for
        the operators the accelerator does not take)."""
        first: str | tuple[str, dict[str, str]] = (
            (self.ort_name, dict(self.options)) if self.options else self.ort_name
        )
        return [first] if self.name == "cpu" else [first, ORT_NAMES["cpu"]]


CPU = ProviderChoice("cpu")


def default_threads() -> int:
    """CPU threads for ONNX Runtime: the cores this process may use. ORT's own default
    counts the host's physical cores, which oversubscribes a container or a pinned
    process (up to twice the time per token on a 2-core slice; docs/BENCHMARKS.md)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def available_providers() -> list[str]:
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def available_names(ort_available: Sequence[str] | None = None) -> list[str]:
    """Our names ("npu", "cuda", "cpu") of the providers this build offers."""
    present = set(available_providers() if ort_available is None else ort_available)
    return [name for name in AUTO_ORDER if ORT_NAMES[name] in present]


def choose_provider(
    requested: str = "auto",
    *,
    config_file: str | None = None,
    cache_dir: str | None = None,
    cache_key: str | None = None,
    ort_available: Sequence[str] | None = None,
) -> ProviderChoice:
    """Resolve `requested` to a provider this machine has, or raise ProviderUnavailable."""
    requested = requested.lower()
    if requested not in REQUESTABLE:
        raise ValueError(f"unknown provider {requested!r}; choose one of {', '.join(REQUESTABLE)}")
    present = available_names(ort_available)
    if requested == "auto":
        name = next(name for name in AUTO_ORDER if name in present or name == "cpu")
    elif requested in present:
        name = requested
    else:
        raise ProviderUnavailable(
            f"draft provider {requested!r} ({ORT_NAMES[requested]}) was requested but this "
            f"ONNX Runtime build only offers {', '.join(present) or 'none'} "
            f"({', '.join(ORT_NAMES[p] for p in present)}). " + _install_hint(requested)
        )
    options: dict[str, str] = {}
    if name == "npu":
        given = {"config_file": config_file, "cache_dir": cache_dir, "cache_key": cache_key}
        options = {
            VITISAI_OPTION_KEYS[key]: str(value)
            for key, value in given.items()
            if value is not None
        }
    return ProviderChoice(name, options)


def _install_hint(name: str) -> str:
    if name == "npu":
        return (
            "Install AMD's Ryzen AI build of onnxruntime (with the VitisAI provider) and "
            "the XDNA driver, or run the drafter on the cpu provider."
        )
    return "Install onnxruntime-gpu matching your CUDA, or run the drafter on the cpu provider."


def check_session_providers(choice: ProviderChoice, session_providers: Sequence[str]) -> None:
    """ONNX Runtime drops a provider that fails to initialise (missing driver or
    library) with only a warning; the drafter must not then claim to run on it."""
    if session_providers and session_providers[0] != choice.ort_name:
        raise ProviderUnavailable(
            f"ONNX Runtime did not start {choice.ort_name} for the draft model "
            f"(session runs on {', '.join(session_providers)}); check the driver and the "
            f"provider's libraries."
        )


def cross_check_against_cpu(
    choice: ProviderChoice,
    model_name: str,
    accelerated_logits: np.ndarray,
    cpu_logits: Callable[[], np.ndarray],
    *,
    atol: float = CROSS_CHECK_ATOL,
    rtol: float = CROSS_CHECK_RTOL,
) -> None:
    """Refuse an accelerator whose first-step logits disagree with the CPU provider's.

    The VitisAI provider has returned wrong values for some multi-output graphs; a
    drafter that silently proposes garbage only shows up as a mysteriously low
    acceptance rate, so compare once at start-up instead.
    """
    reference = np.asarray(cpu_logits(), dtype=np.float32)
    got = np.asarray(accelerated_logits, dtype=np.float32)
    if got.shape != reference.shape:
        raise ProviderMismatch(
            f"{model_name}: logits from {choice.ort_name} have shape {got.shape}, "
            f"CPU gives {reference.shape}"
        )
    error = np.abs(got - reference)
    allowed = atol + rtol * np.abs(reference)
    # Within these bounds a greedy choice can only flip on a near tie (a margin under
    # twice the bound), which the target's verification absorbs anyway.
    if not np.all(np.isfinite(got)) or np.any(error > allowed):
        worst = int(np.argmax(error - allowed))
        raise ProviderMismatch(
            f"{model_name}: first-step logits on {choice.ort_name} disagree with the CPU "
            f"provider (max |diff| {float(np.nanmax(error)):.4g} at token {worst}, argmax "
            f"{int(np.argmax(got))} vs {int(np.argmax(reference))}); refusing to draft on "
            f"{choice.name}. Use the cpu provider, or another export of the model."
        )
    log.info(
        "%s: %s logits match CPU (max |diff| %.3g)",
        model_name,
        choice.name,
        float(error.max()),
    )


# A fixed, model-independent probe for the start-up comparison: ordinary ids well
# inside every Qwen-family vocabulary (and any vocabulary of 1,000 tokens or more).
def probe_tokens(vocab_size: int, length: int = 8) -> list[int]:
    return [(7 + 131 * i) % max(vocab_size, 1) for i in range(length)]
