"""HTTP routes of the proxy (OpenAI and llama.cpp native), SSE, and pass-through."""

from proxy.api.app import STATE, ProxyState, build_state, create_app

__all__ = ["STATE", "ProxyState", "build_state", "create_app"]
