"""Tests of the model and its decode attention kernel (tailrl/model/).

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
