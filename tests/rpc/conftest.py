"""The proxy tests' fixtures (drafters, HTTP session), shared with the RPC tests."""

from tests.proxy.conftest import drafter_for, http, reference_drafter  # noqa: F401
