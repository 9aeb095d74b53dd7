"""The regime server: a stand-in for llama-server b11434 that speaks the API surface the
proxy uses, with llama-server's slot, cache and batching semantics, a scripted target
(deterministic greedy output) and a clock that charges what a chosen machine would
charge (a regime file). The whole proxy runs unchanged in front of it, so a regime's
numbers come from the real engine, policies and drafter overlap.

Benchmark tooling: nothing in the proxy's runtime imports it.
"""
