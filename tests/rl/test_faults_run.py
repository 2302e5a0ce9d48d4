"""A run's folder, checkpoints and process: never silently replaced, never half-written, never a traceback
on Ctrl-C/SIGTERM (issue 12, classes 1, 2, 7 and 8)."""

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from tailrl.rl.checkpoint.store import CheckpointError
from tailrl.rl.run import train
from tailrl.rl.checkpoint.run_dir import RunDirError
from tailrl.rl.checkpoint.state_io import read_state
from tailrl.rl.trainer import Trainer
from tests.rl_helpers import small_cfg

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

ROOT = str(Path(__file__).resolve().parents[2])
BUILTIN_REWARD = ("reward.functions=[math]", "reward.weights=[1.0]")  # no worker process: cheaper


def cfg(tiny_chat, task_file, out, *extra):
    return small_cfg(tiny_chat, task_file, out, *BUILTIN_REWARD, *extra)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_run_folder_is_never_silently_replaced(tiny_chat, task_file, tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))
    with caplog.at_level(logging.WARNING):
        train(cfg(tiny_chat, task_file, run, "trainer.steps=1"))
    assert "which is gone: taking it over" in caplog.text  # a stale lock of a dead process on this host
    assert not (run / "run.lock").exists()
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match=r"holds a run already.*trainer\.resume=true.*trainer\.overwrite=true"):
        train(cfg(tiny_chat, task_file, run, "trainer.steps=1"))
    assert (run / "metrics.jsonl").read_text() == before and (run / "checkpoints" / "step_000001").is_dir()
    assert not (run / "run.lock").exists()
    (run / "checkpoints" / "step_000001" / "marker").write_text("old run")
    train(cfg(tiny_chat, task_file, run, "trainer.steps=1", "trainer.overwrite=true"))
    assert not (run / "checkpoints" / "step_000001" / "marker").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_second_run_in_a_folder_names_the_holder(tiny_chat, task_file, tmp_path):
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": "2030-01-01 00:00:00"}
    (tmp_path / "run.lock").write_text(json.dumps(holder))
    with pytest.raises(RunDirError, match=rf"in use by another run: pid {os.getpid()} on {socket.gethostname()}, "
                                          r"started 2030-01-01 00:00:00"):
        train(cfg(tiny_chat, task_file, tmp_path, "trainer.steps=1"))
    assert json.loads((tmp_path / "run.lock").read_text()) == holder  # the holder's lock stays


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   # what safetensors raises when a write fails (seen here with RLIMIT_FSIZE)
                                   SafetensorError("Error while serializing: I/O error: No space left on device "
                                                   "(os error 28)")])
def test_checkpoints_survive_a_full_disk_and_never_hold_nan(tiny_chat, task_file, tmp_path, monkeypatch, error):
    t = Trainer(cfg(tiny_chat, task_file, tmp_path, "trainer.keep_checkpoints=1", "trainer.save_optimizer_final=false"))
    try:
        root = tmp_path / "checkpoints"
        t.save()
        import tailrl.rl.checkpoint.state_io as state_io

        def full_disk(*a, **k):
            raise error

        with monkeypatch.context() as m:
            m.setattr(state_io, "save_file", full_disk)
            t.step = 1
            with pytest.raises(CheckpointError, match=r"No space left on device.*MB free on that disk.*"
                                                      r"previous checkpoint \(step_000000\) is intact"):
                t.save()
        assert (root / "latest").read_text() == "step_000000" and not list(root.glob(".tmp*"))
        assert read_state(root / "step_000000")["step"] == 0
        with torch.no_grad():
            next(t.policy.parameters())[0, 0] = float("nan")
        with pytest.raises(CheckpointError, match="NaN/inf"):
            t.save()
        assert not (root / "step_000001").exists() and (root / "latest").read_text() == "step_000000"
        with torch.no_grad():
            next(t.policy.parameters())[0, 0] = 0.0
        t.step = 2
        t.save(final=True)  # keep_checkpoints=1, no optimizer state in the final save
        assert [p.name for p in root.iterdir() if p.is_dir()] == ["step_000002"]
        assert read_state(root / "step_000002")["optimizer"] is None
    finally:
        t.close()


def test_sigterm_stops_cleanly_and_prints_the_resume_command(tiny_chat, task_file, tmp_path):
    run = tmp_path / "run"
    args = [f"model.path={tiny_chat}", f"data.train_file={task_file}", f"trainer.out_dir={run}", "trainer.steps=1000",
            "trainer.save_every=1", "trainer.eval_every=0", "rollout.n=2", "trainer.prompts_per_step=1",
            "rollout.max_tokens=4", "algo.mini_batch_size=2", "rollout.kv_cache_gb=0.01", "reward.functions=[math]"]
    proc = subprocess.Popen([sys.executable, "-m", "tailrl.cli", "train", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert "stopped by SIGTERM" in err and "latest checkpoint: " + str(run / "checkpoints" / "step_") in err
    assert "resume with: tailrl train " in err and err.rstrip().endswith("trainer.resume=true")
    assert not (run / "run.lock").exists()


def test_a_disk_too_small_for_the_checkpoints_is_warned_about(tmp_path, monkeypatch):
    from collections import namedtuple

    import tailrl.rl.checkpoint.store as ck

    model = torch.nn.Linear(1000, 1000)  # 1.0M parameters: 12 MB per checkpoint with AdamW's moments
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: Usage(10**12, 0, 100 * 2**20))
    assert ck.disk_warning(tmp_path / "run" / "checkpoints", model, keep=2) is None  # 100 MB >= 3 x 12 MB
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: Usage(10**12, 0, 30 * 2**20))
    msg = ck.disk_warning(tmp_path / "run" / "checkpoints", model, keep=2)
    assert msg and f"under {tmp_path}" in msg and "3 x 0.01 GB" in msg and "keep_checkpoints=2" in msg
