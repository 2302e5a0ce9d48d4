"""`tailrl train --preset tools rollout.partial=true rollout.workers=2` (rollout/remote_partial.py): on the
batch-invariant engine the Ray workers carry and train the trajectories the in-process run does, so a 2-worker run
stopped after step 2 and resumed ends with the straight 1-worker run's metrics and weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tailrl.config import load_config
from tailrl.model.tiny import TOOL_WORDS, make_tiny_chat_model
from tailrl.rl.checkpoint.state_io import read_state
from tailrl.rl.run import train

# the fast tier (pytest -m 'not slow') leaves out runs and Ray; a local Ray cluster per module (conftest.py)
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]

# the tools preset (tool_chain prompts, the calculator, the math reward) on the tiny tool model, small: 3 steps of 2
# prompts x 4 samples of up to 32 tokens, fp32 on the batch-invariant engine (runs compared token for token)
TOOLS = ("rollout.partial=true", "model.dtype=float32", "rollout.batch_invariant=true", "rollout.n=4",
         "rollout.max_tokens=32", "trainer.prompts_per_step=2", "algo.mini_batch_size=8", "algo.micro_batch_size=8",
         "algo.lr=0.02", "algo.lr_schedule=constant", "trainer.save_every=1", "trainer.eval_every=0",
         "data.num_eval=2", "trainer.report=false", "rollout.kv_cache_gb=0.1")
WORKERS = ("rollout.workers=2", "rollout.worker_threads=1", "cluster.round_s=0.05")


def _run(folder, out, *extra):
    return train(load_config(None, [f"model.path={folder}", f"trainer.out_dir={out}", *TOOLS, *extra], preset="tools"))


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_tools_preset_with_partial_rollouts_on_two_workers_resumed_equals_one_worker_straight(tmp_path):
    folder = str(make_tiny_chat_model(tmp_path / "toolchat", seed=3, words=TOOL_WORDS))
    one, two = tmp_path / "one", tmp_path / "two"
    _run(folder, one, "trainer.steps=3")
    _run(folder, two, "trainer.steps=2", *WORKERS)
    state = read_state(two / "checkpoints" / "step_000002")
    carried = [r["state"] for g in state["partial"]["groups"] for r in g["responses"] if not r["comp"]]
    assert any(st.get("trajectory") and st["output_ids"] for st in carried)  # trajectories carried, begun
    _run(folder, two, "trainer.steps=3", "trainer.resume=true", *WORKERS)
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in a] == [1, 2, 3] == [r["step"] for r in b]
    assert sum(r["agent/tool_calls"] for r in a) > 0 and a[1]["rollout/partial_buffered"] > 0
    ran = [r for r in b if "cluster/rounds" in r]  # the steps that rolled out (one may be served from the buffer)
    assert ran and all(r["cluster/rounds"] > 0 and r["cluster/worker_failures"] == 0 for r in ran)
    assert sum(r["rollout/partial_carried"] for r in b) > 0
    exact = [k for k in a[-1] if k.startswith(("reward/", "response_length", "rollout/partial", "rollout/stale",
                                               "rollout/offpolicy", "actor/pg_loss", "agent/masked_share"))]
    assert "reward/mean" in exact
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in exact} == {k: rb[k] for k in exact}, ra["step"]
        # per-trajectory means merged over the workers (weighted by their trajectories): equal up to float rounding
        for k in ("agent/turns", "agent/tool_calls", "agent/max_turns_hit"):
            assert ra.get(k) == pytest.approx(rb.get(k), rel=1e-9, abs=1e-12), (ra["step"], k)
    wa, wb = (load_file(str(d / "checkpoints/step_000003/model/model.safetensors")) for d in (one, two))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
