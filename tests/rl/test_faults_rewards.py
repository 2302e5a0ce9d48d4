"""Rewards are checked: invalid values counted, wrong lengths and always-failing functions stop the run, a
hanging function costs one timeout a step, the worker dies with the run (issue 12, classes 3 and 7)."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tailrl.config import load_config
from tailrl.rl.rewards.runner import RewardError, RewardRunner

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

ROOT = str(Path(__file__).resolve().parents[2])


def invalid_values(prompts, completions, **_):
    return [float("nan"), None, float("-inf"), "high", 1.0][: len(completions)]


def one_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def always_raises(prompts, completions, **_):
    raise RuntimeError("reward bug")


def spins(prompts, completions, **_):
    Path(os.environ["TAILRL_TEST_SPIN"]).write_text(str(os.getpid()))
    while True:  # a stuck function keeps a core busy
        pass


def score(runner, n=5):
    return runner(["p"] * n, [f"#### {i}" for i in range(n)], {"answer": [str(i) for i in range(n)]})


def test_invalid_values_are_counted_and_named(caplog):
    runner = RewardRunner(["tests.rl.test_faults_rewards:invalid_values"], timeout_s=30)
    try:
        with caplog.at_level(logging.WARNING):
            total, stats = score(runner)
    finally:
        runner.close()
    assert total == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert stats.invalid == 4 and stats.errors == 0
    assert "tests.rl.test_faults_rewards:invalid_values" in caplog.text and "reward/invalid" in caplog.text


def test_wrong_number_of_values_names_the_function_and_both_lengths():
    runner = RewardRunner(["tests.rl.test_faults_rewards:one_short"], timeout_s=30)
    try:
        with pytest.raises(RewardError, match=r"one_short returned 4 values for 5 completions"):
            score(runner)
    finally:
        runner.close()


def test_a_function_failing_on_every_sample_stops_the_run_after_max_failed_steps():
    runner = RewardRunner(["math", "tests.rl.test_faults_rewards:always_raises"], timeout_s=30, max_failed_steps=2)
    try:
        _, stats = score(runner, 2)
        assert stats.errors == 2
        with pytest.raises(RewardError, match=r"always_raises gave no valid value for any sample in 2 steps"):
            score(runner, 2)
    finally:
        runner.close()


def test_a_hanging_function_is_called_once_a_step(tmp_path, monkeypatch):
    """Today's runner retried each of the N samples after the batch timed out: N + 1 timeouts a step."""
    calls = tmp_path / "calls"
    monkeypatch.setenv("TAILRL_TEST_CALLS", str(calls))
    runner = RewardRunner(["tests.rl_helpers:hangs_and_counts", "math"], timeout_s=1)
    try:
        total, stats = score(runner, 4)
    finally:
        runner.close()
    assert calls.read_text().split() == ["4"]
    assert stats.timeouts == 4 and total == [1.0] * 4  # math still scores


def test_user_functions_weigh_one_unless_told_and_modules_are_found_in_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    cfg = load_config(None, ["reward.functions=[math,my_rewards:f]"])
    runner = RewardRunner(cfg.reward.functions, cfg.reward.weights, timeout_s=60)
    try:
        assert runner.weights == [1.0, 1.0]
        total, _ = score(runner, 2)
        assert total == [3.0, 3.0]
    finally:
        runner.close()
    assert RewardRunner(["math_partial", "format"]).weights == [1.0, 0.2]  # the default run's shaping term


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()  # a zombie no longer runs
    except FileNotFoundError:
        return True


def test_a_stuck_reward_worker_dies_with_the_run(tmp_path):
    spin = tmp_path / "spin_pid"
    script = textwrap.dedent("""
        import threading, time
        from tailrl.rl.rewards.runner import RewardRunner
        if __name__ == "__main__":
            runner = RewardRunner(["tests.rl.test_faults_rewards:spins"], timeout_s=600)
            threading.Thread(target=lambda: runner(["p"], ["c"], {"answer": ["1"]}), daemon=True).start()
            time.sleep(600)
        """)
    (tmp_path / "run.py").write_text(script)
    env = {**os.environ, "TAILRL_TEST_SPIN": str(spin), "PYTHONPATH": ROOT}
    trainer = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (spin.exists() and spin.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = int(spin.read_text())
        assert not _gone(worker)
        trainer.send_signal(signal.SIGKILL)  # the trainer dies without any cleanup
        trainer.wait()
        deadline = time.monotonic() + 30
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(worker), "the reward worker outlived the run"
    finally:
        trainer.kill()
        if spin.exists() and spin.read_text() and not _gone(int(spin.read_text())):
            os.kill(int(spin.read_text()), signal.SIGKILL)
