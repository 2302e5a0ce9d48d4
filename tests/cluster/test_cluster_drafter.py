"""TLT on idle rollout workers: a worker with nothing left to decode trains its copy of the EAGLE head on the
hidden states of what it finished; the driver merges the copies between steps; the rollout stays the policy's
(checked at greedy, where verification makes the tokens independent of the drafts; sampled rollouts with a
learned drafter are exact in distribution, not token for token, as drafts carry probabilities)."""

import dataclasses

import pytest
import torch

from tailrl.cluster.config import ClusterConfig
from tailrl.cluster.rollout import ClusterRollout
from tailrl.cluster.workers import WorkerSpec
from tailrl.drafter.config import DrafterConfig
from tailrl.drafter.eagle import EagleDrafter
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rollout.ray_worker import head_state, merge_heads
from tailrl.speculative.config import SpecConfig
from tailrl.model.tiny import make_tiny_chat_model

# the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray; a local Ray cluster per module (conftest.py)
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def test_idle_workers_train_the_drafter_and_the_rollout_stays_exact(tmp_path):
    folder = str(make_tiny_chat_model(tmp_path / "tiny"))
    model, tok = load_model(folder, device="cpu")
    torch.manual_seed(0)
    head = EagleDrafter(model.config).bind(model)
    d = DrafterConfig(enabled=True, draft_vocab=0, batch_tokens=64, buffer_tokens=4096, spot_micro_tokens=0)
    ecfg = EngineConfig(kv_cache_gb=0.05, max_num_seqs=8, spec=SpecConfig(mode="learned"))
    spec = WorkerSpec(model=folder, engine=ecfg, factory="tailrl.rollout.ray_worker:build",
                      options={"drafter": dataclasses.asdict(d), "seed": 0})
    # one long group on worker 0, short ones on worker 1: worker 1 goes idle first and trains
    prompts = ["1 + 2 =", "a b", "c d", "e"]
    params = [SamplingParams(n=4, max_tokens=48 if i == 0 else 6, temperature=0.0, seed=7 * i) for i in range(4)]
    ref = Engine(model, tok, EngineConfig(kv_cache_gb=0.05, max_num_seqs=8)).generate(prompts, params)
    cr = ClusterRollout(spec, 2, ClusterConfig(placement="static", migrate=False, round_steps=1, round_s=0.02))
    try:
        for step in range(2):
            cr.sync_weights(model.state_dict(), head_state(head))
            out = cr.generate(prompts, params)
            assert [c.token_ids for c in out] == [c.token_ids for c in ref]
            before = head_state(head)
            steps = merge_heads(head, cr.idle_states)
        assert cr.metrics["cluster/idle_train_s"] > 0 and cr.metrics["cluster/idle_train_share"] > 0
        assert steps > 0 and not torch.equal(before["fc"]["weight"], head.fc.weight)
        assert "learned" in out.stats.drafters
    finally:
        cr.shutdown()
