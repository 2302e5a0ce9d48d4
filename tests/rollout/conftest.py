"""Tests of the rollout backends (tailrl/rollout/): the turn loop and vLLM.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
