"""Inside a step: non-finite values never reach the weights, a rejected prompt fails alone, and a length the
model cannot hold is an error (issue 12, classes 2, 5 and 9)."""

import json

import pytest
import torch

from tailrl.rl.guards import RunStalledError
from tailrl.rl.run import train
from tailrl.rl.trainer import Trainer
from tests.rl_helpers import small_cfg, write_task

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

BUILTIN_REWARD = ("reward.functions=[math]", "reward.weights=[1.0]")


def test_non_finite_loss_skips_the_update_and_stops_the_run(tiny_chat, task_file, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from tailrl.rl import algos

    from tailrl.model import load_model

    def nan_loss(logp, *a, **k):
        return (logp * float("nan")).sum(), {"pg_clipfrac": 0.0, "ppo_kl": 0.0}

    monkeypatch.setitem(algos.POLICY_LOSSES, "ppo", nan_loss)  # the update picks its loss from this table
    initial = load_model(tiny_chat, device="cpu")[0].state_dict()
    cfg = small_cfg(tiny_chat, task_file, tmp_path / "run", *BUILTIN_REWARD, "trainer.steps=5",
                    "trainer.max_skipped_steps=2",
                    "algo.skip_zero_advantage=false")  # every sequence computed, so every step meets the NaN loss
    with pytest.raises(RunStalledError, match=r"2 steps in a row without a policy update.*non-finite"):
        train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_steps"] for r in rows] == [1, 1]
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_000001" / "model" / "model.safetensors"))
    assert all(torch.equal(saved[k], initial[k]) for k in saved)  # the skipped update never touched the weights


def test_a_prompt_rejected_mid_step_leaves_the_step_with_a_metric(tiny_chat, tmp_path):
    long_prompt = {"prompt": " ".join(["a"] * 150), "answer": "1"}  # fits max_prompt_tokens, not the KV budget
    data = write_task(tmp_path / "d.jsonl", n=3, extra_rows=[long_prompt])
    kv_gb = 100 * 768 / 2**30  # 100 tokens of this tiny model's KV cache in fp32 (model.dtype pinned to it)
    cfg = small_cfg(tiny_chat, data, tmp_path / "run", *BUILTIN_REWARD, "trainer.steps=1", "data.num_eval=0",
                    "trainer.prompts_per_step=4", f"rollout.kv_cache_gb={kv_gb}", "model.dtype=float32")
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout/rejected"] == 1
    assert len(rows[-1]["response_lengths"]) == 3 * 4 and "actor/pg_loss" in rows[-1]


def test_max_tokens_beyond_the_model_context_is_an_error(tiny_chat, task_file, tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.max_tokens=600 does not fit the context .* \(512 tokens"):
        Trainer(small_cfg(tiny_chat, task_file, tmp_path, "rollout.max_tokens=600"))


def test_a_mislabelled_rollout_stops_the_step_before_it_is_scored():
    """A completion must sit at its (prompt, sample) place and carry that prompt's tokens (the cluster driver once
    returned migrated samples under other prompts' indices): else the step stops instead of scoring it against
    another prompt's answer. A rejected prompt's completions (no tokens) pass."""
    from types import SimpleNamespace as NS

    from tailrl.rl.guards import check_rollout_labels

    examples = [NS(ids=[5, 6, 7]), NS(ids=[8, 9])]
    comps = [NS(prompt_index=i, sample_index=j, prompt_token_ids=list(examples[i].ids), finish_reason="stop")
             for i in range(2) for j in range(2)]
    check_rollout_labels(examples, comps, 2)
    check_rollout_labels(examples, comps[:2] + [NS(prompt_index=1, sample_index=j, prompt_token_ids=[],
                                                   finish_reason="error") for j in range(2)], 2)
    swapped = [comps[0], comps[2], comps[1], comps[3]]  # two samples under each other's place
    with pytest.raises(RuntimeError, match="rollout completion 1 is labelled"):
        check_rollout_labels(examples, swapped, 2)
    relabelled = comps[:3] + [NS(prompt_index=1, sample_index=1, prompt_token_ids=[5, 6, 7], finish_reason="stop")]
    with pytest.raises(RuntimeError, match="should answer .prompt 1, sample 1. with that prompt's tokens"):
        check_rollout_labels(examples, relabelled, 2)
    with pytest.raises(RuntimeError, match="3 completions for 2 prompts x 2"):
        check_rollout_labels(examples, comps[:3], 2)
