"""Test support: code the tests share that is no part of the runtime."""
