"""Tests of the Ray rollout workers, placement and migration (tailrl/cluster/).

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
