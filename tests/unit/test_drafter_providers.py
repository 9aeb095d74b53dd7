"""Execution-provider choice and the CPU cross-check, with providers simulated as absent
or present (this machine has only CPUExecutionProvider)."""

from __future__ import annotations

import numpy as np
import pytest

from npu_draft import providers
from npu_draft.providers import (
    ProviderChoice,
    ProviderMismatch,
    ProviderUnavailable,
    check_session_providers,
    choose_provider,
    cross_check_against_cpu,
)

CPU_ONLY = ["AzureExecutionProvider", "CPUExecutionProvider"]
WITH_CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
WITH_ALL = ["VitisAIExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


@pytest.mark.parametrize(
    ("available", "expected"),
    [(CPU_ONLY, "cpu"), (WITH_CUDA, "cuda"), (WITH_ALL, "npu"), ([], "cpu")],
)
def test_auto_prefers_npu_then_cuda_then_cpu(available: list[str], expected: str) -> None:
    assert choose_provider("auto", ort_available=available).name == expected


def test_auto_on_this_machine_is_a_real_provider() -> None:
    import onnxruntime

    choice = choose_provider("auto")
    assert choice.ort_name in onnxruntime.get_available_providers()


@pytest.mark.parametrize("requested", ["npu", "cuda"])
def test_absent_provider_is_a_startup_error_naming_what_exists(requested: str) -> None:
    with pytest.raises(ProviderUnavailable) as caught:
        choose_provider(requested, ort_available=CPU_ONLY)
    message = str(caught.value)
    assert providers.ORT_NAMES[requested] in message
    assert "CPUExecutionProvider" in message and "only offers cpu" in message


def test_unknown_provider_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown provider 'tpu'"):
        choose_provider("tpu", ort_available=WITH_ALL)


def test_vitisai_options_use_the_providers_own_keys() -> None:
    choice = choose_provider(
        "npu",
        config_file="/opt/vaip_config.json",
        cache_dir="/tmp/vaip",
        cache_key="qwen3-draft",
        ort_available=WITH_ALL,
    )
    assert choice.ort_providers() == [
        (
            "VitisAIExecutionProvider",
            {
                "config_file": "/opt/vaip_config.json",
                "cacheDir": "/tmp/vaip",
                "cacheKey": "qwen3-draft",
            },
        ),
        "CPUExecutionProvider",
    ]
    # options only matter to the NPU
    assert choose_provider("cuda", cache_dir="/x", ort_available=WITH_ALL).options == {}
    assert ProviderChoice("cpu").ort_providers() == ["CPUExecutionProvider"]


def test_session_that_silently_fell_back_is_refused() -> None:
    npu = ProviderChoice("npu")
    check_session_providers(npu, ["VitisAIExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(ProviderUnavailable, match="did not start VitisAIExecutionProvider"):
        check_session_providers(npu, ["CPUExecutionProvider"])


def test_cross_check_accepts_rounding_and_refuses_wrong_values() -> None:
    reference = np.random.default_rng(0).normal(0, 4, 1000).astype(np.float32)
    reference[17] = 30.0  # a clear argmax
    npu = ProviderChoice("npu")
    cross_check_against_cpu(npu, "m", reference + 1e-3, lambda: reference)

    wrong = reference.copy()
    wrong[500] += 1.0
    with pytest.raises(ProviderMismatch) as caught:
        cross_check_against_cpu(npu, "draft-x", wrong, lambda: reference)
    assert "draft-x" in str(caught.value) and "token 500" in str(caught.value)

    with pytest.raises(ProviderMismatch, match="shape"):
        cross_check_against_cpu(npu, "m", reference[:10], lambda: reference)
    nan = reference.copy()
    nan[3] = np.nan
    with pytest.raises(ProviderMismatch):
        cross_check_against_cpu(npu, "m", nan, lambda: reference)


def test_probe_tokens_stay_inside_the_vocabulary() -> None:
    for vocab in (1000, 151_936):
        probe = providers.probe_tokens(vocab)
        assert len(probe) == 8 and all(0 <= t < vocab for t in probe)
