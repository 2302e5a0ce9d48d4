"""Resume says what it does and does it fully: fallbacks past corrupt files, config changes listed and
applied, a cut-off metrics line survived (issue 12, class 4)."""

import json
import logging

import pytest

from tailrl.report import make_report
from tailrl.rl.run import train
from tailrl.rl.trainer import Trainer
from tests.rl_helpers import small_cfg

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

BUILTIN_REWARD = ("reward.functions=[math]", "reward.weights=[1.0]")


def test_resume_falls_back_past_corrupt_files_and_lists_config_changes(tiny_chat, task_file, tmp_path, capsys, caplog):
    def cfg(*extra):
        return small_cfg(tiny_chat, task_file, tmp_path, *BUILTIN_REWARD, *extra)

    train(cfg("trainer.steps=2"))
    ckpts = tmp_path / "checkpoints"
    (ckpts / "latest").write_text("step_00")  # cut off while written
    weights = ckpts / "step_000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated checkpoint file
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # a run killed while writing a metrics line
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        t = Trainer(cfg("trainer.steps=3", "trainer.resume=true", "algo.lr=0.005"))
        try:
            assert t.resume() and t.step == 1
            assert all(g["lr"] == 0.005 for g in t.optimizer.param_groups)  # the new rate applies
        finally:
            t.close()
    out = capsys.readouterr().out
    assert f"resumed from step 1 ({ckpts / 'step_000001'})" in out
    assert "algo.lr: 0.02 -> 0.005" in out and "trainer.steps: 2 -> 3" in out
    assert f"{ckpts / 'latest'} is missing or corrupt" in caplog.text
    assert f"{weights}" in caplog.text and "trying the one before" in caplog.text
    train(cfg("trainer.steps=3", "trainer.resume=true", "algo.lr=0.005"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')
    assert "| 3 |" in make_report(tmp_path).read_text()  # the report skips the cut-off line


def test_resume_without_a_checkpoint_says_it_starts_fresh(tiny_chat, task_file, tmp_path, capsys):
    t = Trainer(small_cfg(tiny_chat, task_file, tmp_path, *BUILTIN_REWARD, "trainer.resume=true"))
    try:
        assert not t.resume()
    finally:
        t.close()
    assert f"no checkpoint in {tmp_path / 'checkpoints'}: starting fresh" in capsys.readouterr().out
