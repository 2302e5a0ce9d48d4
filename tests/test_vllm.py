"""The vLLM backend's checks (tests/vllm_checks.py) in a pytest process of their own; skipped only where vLLM is
not installed (`bash scripts/setup.sh --vllm` installs it, and the test command CI runs does)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # vLLM engines in a pytest process of their own: about two minutes
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed: bash scripts/setup.sh --vllm (docs/vllm.md)")
def test_vllm_backend_checks():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                          "tests/vllm_checks.py"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert re.search(r"\b7 passed", run.stdout), run.stdout[-2000:]  # none of them skipped
