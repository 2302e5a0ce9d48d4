"""Tests of speculative decoding (tailrl/speculative/): drafts, verification, the selector, the audit.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
