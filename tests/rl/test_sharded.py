"""`trainer.world_size=2`: two gloo ranks (Ray actors, one thread each) train the tiny model with FSDP2 to the
weights the one-process trainer reaches, write sharded checkpoints that resume at 1 and at 2 ranks, hold about
half the parameter and optimizer bytes each, and a rank that dies mid-update stops the run with an error
naming it, the step and the latest checkpoint."""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from tailrl.rl.actor import group as actor_group
from tailrl.rl.actor.group import RankFailed
from tailrl.rl.run import train
from tailrl.model.tiny import make_tiny_chat_model
from tests.rl_helpers import tiny_cfg, write_task

# fp32 throughout; the ranks sum the same gradients in another order (reduce-scatter, two halves of each
# mini-batch), and Adam divides by sqrt(v), so the weights agree to float rounding amplified over 3 steps
# (measured: 1.9e-5 at most after 3 steps, 1e-6 after a resume at one rank, 0 after a resume at two)
ATOL = 1e-4


pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]  # a local Ray cluster per module (conftest.py)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    return str(make_tiny_chat_model(d / "chat")), write_task(d / "train.jsonl")


def cfg(setup, out, *extra):
    chat, task = setup
    return tiny_cfg(chat, task, out, "model.dtype=float32", "trainer.steps=3", "trainer.keep_checkpoints=3",
                    "algo.mini_batch_size=8", "trainer.collective_timeout_s=60", *extra)


def weights(ckpt) -> dict:
    out = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |difference| {worst:.3g}")
    assert worst < ATOL, f"max |difference| {worst:.3g}"


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_match_one_and_resume_at_one_and_two(setup, tmp_path):
    t0 = time.perf_counter()
    one = train(cfg(setup, tmp_path / "one"))
    two = train(cfg(setup, tmp_path / "two", "trainer.world_size=2"))
    a, b = rows(one), rows(two)
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]  # the same rollouts
    w1, w2 = weights(one / "checkpoints" / "step_000003"), weights(two / "checkpoints" / "step_000003")
    assert_close(w1, w2)
    assert not torch.equal(w1["model.norm.weight"], weights(two / "checkpoints" / "step_000001")["model.norm.weight"])
    # about half the fp32 parameters and the two AdamW moments on each rank
    total = 4 * sum(t.numel() for t in w1.values())
    for r in b:
        assert 0.45 * total <= r["actor/param_bytes_per_rank"] <= 0.55 * total, (r["actor/param_bytes_per_rank"], total)
        assert 0.9 * total <= r["actor/optimizer_bytes_per_rank"] <= 1.1 * total
        assert r["sync/bytes"] == total and r["timing_s/sync"] > 0
    # a checkpoint written at 2 ranks, resumed at 1 and at 2: the next step matches the never-stopped run
    for world in (1, 2):
        run = tmp_path / f"resume{world}"
        shutil.copytree(two, run)
        shutil.rmtree(run / "checkpoints" / "step_000003")
        (run / "checkpoints" / "latest").write_text("step_000002")
        train(cfg(setup, run, f"trainer.world_size={world}", "trainer.resume=true"))
        assert_close(weights(run / "checkpoints" / "step_000003"), w2)
        assert [r["reward/mean"] for r in rows(run)] == [r["reward/mean"] for r in b]
    print(f"sharded train + 2 resumes: {time.perf_counter() - t0:.1f} s")


def test_a_rank_that_dies_mid_update_stops_the_run_naming_it(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(actor_group, "FAULT", (1, 1, "exit"))  # rank 1 exits in the update of step 2
    t0 = time.perf_counter()
    with pytest.raises(RankFailed, match=r"trainer rank 1 died .* step 2; the latest checkpoint is step_000001"):
        train(cfg(setup, tmp_path / "run", "trainer.world_size=2", "trainer.collective_timeout_s=30"))
    print(f"stopped {time.perf_counter() - t0:.1f} s after the start (trainer.collective_timeout_s=30)")
