"""Tests of the repository's tools: scripts/import_graph.py and benchmarks/gpu/pieces.py.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
