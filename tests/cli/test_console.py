"""The run's console: a header, one whole line per step, the end's summary in a log written to a file; the
progress line appears on a terminal only, while a phase runs long, and goes away with it."""

import io
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from tailrl.console import RunConsole, eval_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole `tailrl train` in a subprocess
def test_train_into_a_file_gives_a_clean_log(tiny_chat, task_file, tmp_path):
    run = tmp_path / "run"
    args = [f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4", f"trainer.out_dir={run}",
            "trainer.steps=3", "trainer.eval_every=2", "rollout.n=4", "trainer.prompts_per_step=2",
            "rollout.max_tokens=6", "algo.mini_batch_size=8", "rollout.kv_cache_gb=0.1", "reward.functions=[math]",
            "trainer.report=false"]
    with (tmp_path / "run.log").open("w") as log:  # `tailrl train > run.log 2>&1`
        rc = subprocess.run([sys.executable, "-m", "tailrl.cli", "train", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, timeout=600).returncode
    text = (tmp_path / "run.log").read_text()
    assert rc == 0, text
    lines = text.splitlines()
    for label in ("model", "precision", "device", "data", "reward", "steps", "speculation", "run folder", "loggers"):
        assert any(re.match(rf"^\s*{label}  \S", line) for line in lines), (label, text)
    assert any("cpu, " in line and " threads" in line for line in lines)
    assert any(f"{task_file}: 60 train / 4 eval prompts" in line for line in lines)
    assert any(line.strip().startswith("speculation  auto") for line in lines)
    steps = [line for line in lines if re.match(r"^step \d+/3 ", line)]
    assert [int(s.split()[1].split("/")[0]) for s in steps] == [1, 2, 3]  # one line per step
    assert all("accept" in s and s.rstrip().endswith("]") for s in steps)  # whole lines
    assert "eval acc" in steps[1] and "eval acc" not in steps[0]
    assert lines[lines.index(steps[0]) - 1].startswith("step 0: eval acc")
    assert "metrics.py" not in text and "\u2026" not in text and "\r" not in text and "\x1b[" not in text
    assert any(line.startswith("eval accuracy ") and "(step 0) -> " in line for line in lines)
    assert lines[-2:] == [f"metrics: {run / 'metrics.jsonl'}", f"tensorboard --logdir {run / 'tensorboard'}"]


def fake_trainer(phase=None, running=0):
    engine = SimpleNamespace(num_running=running, num_waiting=0, last_stats=SimpleNamespace(generated_tokens=0))
    rollout = SimpleNamespace(progress=lambda: (engine.last_stats.generated_tokens, engine.num_running + engine.num_waiting))
    return SimpleNamespace(phase=phase, step=3, engine=engine, rollout=rollout,
                           cfg=SimpleNamespace(trainer=SimpleNamespace(steps=16)))


def test_the_progress_line_shows_a_long_rollout_on_a_terminal_and_goes_away():
    buf = io.StringIO()
    view = RunConsole(Console(file=buf, force_terminal=True, width=120), progress_after_s=0.2, poll_s=0.02)
    trainer = fake_trainer(("rollout", time.perf_counter()), running=7)
    view.watch(trainer)
    try:
        for _ in range(40):  # the engine emits tokens while the phase runs
            trainer.engine.last_stats.generated_tokens += 50
            time.sleep(0.02)
        shown = buf.getvalue()
        assert re.search(r"step 4/16 rollout \d+s: [\d,]+ tokens, 7 running, \d+ tok/s", shown), shown
        trainer.phase = ("update", time.perf_counter() - 5)
        time.sleep(0.2)
        assert "step 4/16 update 5s" in buf.getvalue()
        view.step(4, 16, {"reward/mean": 0.5})
        assert "step 4/16  reward 0.500" in buf.getvalue()
    finally:
        view.close()
    assert buf.getvalue().endswith("\r\x1b[1A\x1b[2K")  # transient: the line is erased when the run ends


def test_no_progress_line_without_a_terminal_or_for_a_short_phase():
    buf = io.StringIO()
    view = RunConsole(Console(file=buf, force_terminal=False), progress_after_s=0.0, poll_s=0.01)
    view.watch(fake_trainer(("rollout", time.perf_counter()), running=3))
    time.sleep(0.1)
    view.close()
    assert buf.getvalue() == ""
    buf = io.StringIO()
    view = RunConsole(Console(file=buf, force_terminal=True), progress_after_s=30.0, poll_s=0.01)
    view.watch(fake_trainer(("rollout", time.perf_counter()), running=3))
    time.sleep(0.1)
    view.close()
    assert "rollout" not in buf.getvalue()


def test_a_long_line_is_not_cut_to_the_width():
    buf = io.StringIO()
    view = RunConsole(Console(file=buf, force_terminal=False, width=40))
    view.step(12, 16, {"reward/mean": 0.25, "acc/mean": 0.5, "eval/accuracy": 0.75})
    assert len(buf.getvalue().splitlines()) == 1 and "eval acc 0.75" in buf.getvalue()


def test_eval_summary():
    rows = [{"step": 0, "eval/accuracy": 0.06}, {"step": 1}, {"step": 8, "eval/accuracy": 0.72},
            {"step": 16, "eval/accuracy": 0.44}]
    assert eval_summary(rows) == "eval accuracy 0.06 (step 0) -> 0.44 (step 16); best 0.72 at step 8"
    assert eval_summary([{"step": 3}]) is None
