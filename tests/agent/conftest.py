"""Tests of multi-turn tools (tailrl/agent/) and the tool turn loop.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
