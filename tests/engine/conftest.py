"""Tests of the engine (tailrl/engine/): steps, the paged cache, sampling, scoring, the tail, invariance.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
