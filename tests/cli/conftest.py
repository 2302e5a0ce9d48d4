"""Tests of the command line and the run's console, loggers and `tailrl eval` (tailrl/cli*.py, console.py, loggers.py).

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
