"""The vLLM backend's checks (tests/rollout/vllm_checks.py) and `tailrl generate --backend vllm`, each in a process of its
own; skipped only where vLLM is not installed (`bash scripts/setup.sh --vllm` installs it, and the test command CI
runs does). One process per command: vLLM seeds the global RNGs and binds the threads of a process that builds an
LLM, and freeing one in-process LLM tears down the distributed state the others in that process run on."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: bash scripts/setup.sh --vllm (docs/vllm.md)")


def env(**extra) -> dict:
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"), **extra}


def run_checks(file: str, passed: int) -> None:
    """Runs tests/rollout/<file> in a pytest process of its own; every one of its `passed` tests must pass, none
    skipped."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                          f"tests/rollout/{file}"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert re.search(rf"\b{passed} passed", run.stdout), run.stdout[-2000:]


@pytest.mark.slow  # vLLM engines in a pytest process of their own: a few minutes
@needs_vllm
def test_vllm_backend_checks():
    run_checks("vllm_checks.py", 7)


@pytest.mark.slow  # one vLLM engine start in a process of its own: about a minute
@needs_vllm
def test_vllm_agent_checks():
    run_checks("vllm_agent_checks.py", 2)


@pytest.mark.slow  # two vLLM engine starts in a process of their own: about two minutes
@needs_vllm
def test_vllm_turns_checks():
    """agent.tools with our proposer inside vLLM: later turns drafted by turn, the audit of tool trajectories."""
    run_checks("vllm_turns_checks.py", 2)


@pytest.mark.slow  # one vLLM engine start: about a minute
@needs_vllm
def test_generate_with_backend_vllm_writes_the_same_jsonl_and_summary(tmp_path):
    """`tailrl generate --backend vllm --spec tailrl --epochs 2` on the tiny vLLM model: text and prompt_ids rows
    sampled by vLLM with our proposer (the gate skipped: the audit's verdicts are tests/rollout/vllm_checks.py's), a malformed
    row and a prompt outside the vocabulary failing alone, the JSONL rows and the summary line as with our engine."""
    from tailrl.model.tiny import make_tiny_vllm_model

    folder = make_tiny_vllm_model(tmp_path / "m")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n{oops\n{"prompt_ids": [1, 3, 9, 10, 11, 4]}\n'
                       '{"prompt_ids": [1, 999]}\n')
    args = ["generate", "--backend", "vllm", "--spec", "tailrl", "--model", folder, "--prompts", str(prompts),
            "--out", str(out), "--n", "3", "--max-tokens", "8", "--temperature", "1", "--epochs", "2",
            "--dtype", "float32", "--quiet"]
    run = subprocess.run([sys.executable, "-c", f"from tailrl.cli import main; raise SystemExit(main({args!r}))"],
                         cwd=ROOT, env=env(TAILRL_VLLM_AUDIT="skip", VLLM_CPU_KVCACHE_SPACE="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(4) for j in range(3)]
    assert {r["index"] for r in rows if r["finish_reason"] == "error"} == {1, 3} and "vocabulary" in rows[9]["error"]
    good = [r for r in rows if r["index"] in (0, 2)]
    assert all(1 <= len(r["token_ids"]) == len(r["logprobs"]) <= 8 for r in good)
    m = re.search(r"12 completions \(error: 6, [a-z: \d,]+\), (\d+) tokens in [\d.]+s = [\d.]+ tok/s", run.stdout)
    assert m and int(m.group(1)) == sum(len(r["token_ids"]) for r in good), run.stdout
    assert "rollout: vLLM " in run.stdout and "speculation: tailrl (not audited)" in run.stdout
    assert "epoch 0: " in run.stdout
