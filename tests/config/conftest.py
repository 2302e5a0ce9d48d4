"""Tests of config keys, their help and the presets (tailrl/config/, tailrl/presets/).

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
