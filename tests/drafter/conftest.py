"""Tests of the learned drafter (tailrl/drafter/).

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
