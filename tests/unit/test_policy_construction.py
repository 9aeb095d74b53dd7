"""The policies have one constructor (`SharedPolicies.build`, through
`EngineSettings.policies`), fed by every policy setting of the proxy."""

from __future__ import annotations

import dataclasses

from npu_draft.protocol import SamplingParams
from proxy.config import ProxySettings
from proxy.data.sampling import SamplingSpec
from proxy.engine import EngineSettings


def test_every_policy_setting_reaches_the_policies() -> None:
    settings = ProxySettings(
        upstream="http://127.0.0.1:1", k=6, adaptive_k=False, draft_length="marginal",
        overlap="off", plain_runs="off", pad_rounds="on",
    )  # fmt: skip
    shared = EngineSettings.from_settings(settings).policies()
    assert shared.draft_length.k_max == 6 and not shared.draft_length.adaptive
    assert shared.draft_length.rule == "marginal"
    assert shared.overlap.mode == "off"
    assert shared.plain_runs.mode == "off" and shared.sampled_plain_runs.mode == "off"
    assert shared.padding.mode == "on"
    auto = EngineSettings.from_settings(ProxySettings(upstream="http://127.0.0.1:1"))
    assert auto.policies().plain_runs.mode == "auto"  # the proxy's default
    assert auto.policies().padding.mode == "auto"


def test_pad_rounds_still_takes_the_switch_words_it_took_before_it_was_measured() -> None:
    for given, mode in (
        (True, "on"),
        (False, "off"),
        ("true", "on"),
        ("0", "off"),
        ("auto", "auto"),
    ):
        assert ProxySettings(upstream="http://127.0.0.1:1", pad_rounds=given).pad_rounds == mode


def test_each_engine_setting_is_read_from_the_proxy_settings() -> None:
    """No engine setting is left at its default by `from_settings` (a field only one
    path would read)."""
    settings = ProxySettings(upstream="http://127.0.0.1:1")
    engine = EngineSettings.from_settings(settings)
    names = {field.name for field in dataclasses.fields(EngineSettings)}
    proxy_names = {"k": "k", "adaptive": "adaptive_k"}
    for name in names:
        assert getattr(engine, name) == getattr(settings, proxy_names.get(name, name)), name


def test_a_request_gets_the_gate_of_its_kind() -> None:
    shared = EngineSettings(k=3, plain_runs="auto").policies()
    chain = SamplingParams(temperature=0.8, top_k=40)
    assert shared.for_request(None).plain_runs is shared.plain_runs
    unseeded = shared.for_request(SamplingSpec(chain))
    assert unseeded.plain_runs is shared.sampled_plain_runs
    assert shared.for_request(SamplingSpec(chain, seed=7)).plain_runs is None  # always speculates
    assert unseeded.draft_length is shared.draft_length and unseeded.overlap is shared.overlap
