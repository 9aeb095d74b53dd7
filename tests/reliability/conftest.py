"""Fixtures for the reliability suites (faults, load, hostile input).

The reference and speculative llama-servers are the proxy suite's own fixtures;
servers a test kills are started by the test itself and always stopped.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.proxy.conftest import (  # noqa: F401 - fixtures, re-exported for pytest
    SPEC_LAYOUT,
    http,
    ref_server,
    reference_drafter,
    spec_server,
)

# Fixed and derandomized: the same cases on every run, few enough for CI's 2 cores.
settings.register_profile(
    "reliability",
    derandomize=True,
    deadline=None,
    max_examples=40,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
