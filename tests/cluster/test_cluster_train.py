"""`tailrl train rollout.workers=2`: Ray workers give the very rollouts of the in-process engine, so the reward
curve equals the 1-worker curve exactly, across a checkpoint and a resume; rollout.workers=1 never imports Ray."""

import json
import subprocess
import sys

import pytest

from tailrl.rl.run import train
from tailrl.model.tiny import make_tiny_chat_model
from tests.rl_helpers import tiny_cfg, write_task

# the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray; a local Ray cluster per module (conftest.py)
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_workers_train_resume_and_match_one_worker(tmp_path_factory, tmp_path):
    chat = str(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat_train")))
    task = write_task(tmp_path / "train.jsonl")
    # identical rollouts across batch shapes: fp32 here (bf16 batch invariance is measured for SmolLM2's shapes only,
    # engine/invariant.py; this tiny model's matrix products may take other kernels)
    one = train(tiny_cfg(chat, task, tmp_path / "one", "trainer.steps=3", "model.dtype=float32"))
    two = tmp_path / "two"
    workers = ["rollout.workers=2", "rollout.worker_threads=1", "cluster.round_s=0.05", "model.dtype=float32"]
    train(tiny_cfg(chat, task, two, "trainer.steps=2", *workers))
    assert (two / "checkpoints" / "latest").is_file()
    train(tiny_cfg(chat, task, two, "trainer.steps=3", "trainer.resume=true", *workers))
    a, b = rows(one), rows(two)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]  # exactly
    assert [r["response_lengths"] for r in a] == [r["response_lengths"] for r in b]
    for r in b:
        assert r["cluster/worker_failures"] == 0 and "timing_s/sync" in r and "cluster/len_pred_mae" in r


def test_partial_rollouts_on_two_workers_match_one_worker(tmp_path_factory, tmp_path):
    """Partial rollouts stop on a token horizon, not on rounds: the workers carry and train what one engine does."""
    chat = str(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat_partial")))
    task = write_task(tmp_path / "train.jsonl")
    partial = ["rollout.partial=true", "rollout.max_tokens=48", "rollout.n=4", "algo.mini_batch_size=8",
               "trainer.steps=3", "model.dtype=float32", "rollout.batch_invariant=true"]
    train(tiny_cfg(chat, task, tmp_path / "one", *partial))
    train(tiny_cfg(chat, task, tmp_path / "two", *partial, "rollout.workers=2", "rollout.worker_threads=1",
                   "cluster.round_s=0.05"))
    a, b = rows(tmp_path / "one"), rows(tmp_path / "two")
    keys = ["reward/mean", "response_lengths", "rollout/partial_carried", "rollout/staleness_mean"]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert sum(r["rollout/partial_carried"] for r in b) > 0


def test_one_worker_never_imports_ray(tmp_path):
    code = ("import sys; from tailrl.config import load_config; from tailrl.rollout.ray_cluster import make_cluster; "
            "from tailrl.rl import trainer; assert make_cluster(load_config(None, [])) is None; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path.parent), timeout=120)
