"""A resumed partial run equals the run that never stopped on the real model in fp32 (issue 64), where near-ties are
common enough that any difference in what the engine computes shows in the sampled tokens."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tailrl.config import load_config
from tailrl.rl.run import train

pytestmark = pytest.mark.slow

# SmolLM2-135M, fp32 (model.dtype=float32: the plain packed passes, as on an AVX2-only CPU) with speculation off (in
# plain fp32 passes the selector's choices, which follow measured seconds, round logits differently: same
# distribution, not the same bits; engine/invariant.py), 8 tokens a response:
# nearly every response is cut at the cap, so step 1 runs to the end and takes 2 of its 4 groups, step 2 is served
# from the buffer and launches 2 groups it leaves unstarted, and step 3's rollout imports them before its own
RUN = ("model.dtype=float32", "rollout.spec.mode=off", "rollout.partial=true", "trainer.prompts_per_step=2",
       "rollout.n=4", "rollout.max_tokens=8", "algo.mini_batch_size=8", "algo.micro_batch_size=8",
       "algo.lr_schedule=constant", "trainer.save_every=1", "trainer.eval_every=0", "trainer.report=false",
       "rollout.kv_cache_gb=0.2", "data.num_eval=2", "reward.functions=[tests.rl.test_partial_resume:chars]",
       "reward.weights=[1.0]")


def chars(prompts, completions, **_):
    """A reward with a spread in every group (8 tokens are too few for an answer): the update moves the weights."""
    return [len(c) / 40 for c in completions]


def _run(out, *extra):
    return train(load_config(None, [*RUN, f"trainer.out_dir={out}", *extra]))


def _rows(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def test_a_resumed_partial_run_on_smollm2_in_fp32_equals_the_straight_run(tmp_path):
    """Before the fix the run that never stopped decoded step 3's imported responses under the packed weights of
    step 1 (engine.import_ came before add_requests, which alone repacked): its tokens' rollout logprobs were off
    by 0.065 on average where the resumed run's were 3e-6, and rewards differed (0.375 against 0.391 at 128 tokens)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, "trainer.steps=3")
    _run(resumed, "trainer.steps=2")
    _run(resumed, "trainer.steps=3", "trainer.resume=true")
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [1, 2, 3] and [r["step"] for r in b] == [1, 2, 3]
    # the case this test is about: step 3 rolled out and continued responses the buffer held from step 2
    assert a[1]["rollout/partial_buffered"] > 0 and a[2]["rollout/partial_horizon"] > 0
    keys = [k for k in a[2] if k.startswith(("reward/", "response_length", "rollout/partial", "rollout/stale",
                                             "rollout/offpolicy", "rollout/logprob", "actor/pg_loss", "actor/entropy"))]
    assert "rollout/logprob_diff" in keys and {k: a[2][k] for k in keys} == {k: b[2][k] for k in keys}
    if a[2]["rollout/staleness_max"] == 0:  # fresh tokens only: the engine sampled from the policy the trainer holds
        assert a[2]["rollout/logprob_diff"] < 1e-3
    wa, wb = (load_file(str(d / "checkpoints/step_000003/model/model.safetensors")) for d in (straight, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# the tools preset (tool_chain's few-shot prompts, the calculator over 4 turns at most) small, as RUN: 2 prompts x 4
# trajectories of up to 48 tokens a step, fp32, speculation off, `chars` for a spread in every group; on the
# batch-invariant passes, since when a trajectory's next turn joins the batch follows its tool's timing (plain fp32
# passes gave the same tokens with logprobs 1e-7 apart, run to run, from step 1)
TOOLS = (*(x for x in RUN if not x.startswith(("rollout.max_tokens", "reward."))), "rollout.max_tokens=48",
         "reward.functions=[tests.rl.test_partial_resume:chars]", "reward.weights=[1.0]", "rollout.batch_invariant=true")


def test_a_resumed_partial_tools_run_on_smollm2_in_fp32_equals_the_straight_run(tmp_path):
    """`tailrl train --preset tools rollout.partial=true`, stopped after step 2 and resumed: step 3 continues the
    trajectories step 2 carried (mid-turn or after a call's observation) to what the run that never stopped drew."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def run(out, *extra):
        return train(load_config(None, [*TOOLS, f"trainer.out_dir={out}", *extra], preset="tools"))

    run(straight, "trainer.steps=3")
    run(resumed, "trainer.steps=2")
    run(resumed, "trainer.steps=3", "trainer.resume=true")
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [1, 2, 3] and [r["step"] for r in b] == [1, 2, 3]
    assert sum(r["agent/tool_calls"] for r in a) > 0 and a[1]["rollout/partial_buffered"] > 0
    keys = [k for k in a[2] if k.startswith(("reward/", "response_length", "rollout/partial", "rollout/stale",
                                             "rollout/offpolicy", "rollout/logprob", "actor/pg_loss", "actor/entropy",
                                             "agent/turns", "agent/tool_calls", "agent/masked_share"))]
    assert "rollout/logprob_diff" in keys and {k: a[2][k] for k in keys} == {k: b[2][k] for k in keys}
    wa, wb = (load_file(str(d / "checkpoints/step_000003/model/model.safetensors")) for d in (straight, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
