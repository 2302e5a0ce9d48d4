"""DAPO's dynamic sampling (rl/dynamic.py): groups whose samples are all right or all wrong (algo.filter_metric=acc,
the default) or all equally rewarded (reward) leave the batch, rounds of prompts are sampled
until the batch holds trainer.prompts_per_step informative groups or algo.max_gen_rounds ran, and a resumed run
continues exactly."""

import json

import pytest
import torch

from tailrl.engine.sequence import Completion
from tailrl.rl.algos import group_advantages
from tailrl.rl.dynamic import Gathered, informative, merge, merge_rollout
from tailrl.rl.rewards.overlong import overlong_terms
from tailrl.rl.run import train
from tests.rl_helpers import check_rounds, tiny_cfg


def comp(prompt: int, sample: int, n_tokens: int = 3) -> Completion:
    return Completion(seq_id=prompt * 10 + sample, prompt_index=prompt, sample_index=sample, prompt_token_ids=[1, 2],
                      token_ids=list(range(n_tokens)), text="x", logprobs=[-1.0] * n_tokens, finish_reason="stop")


def test_informative_groups_are_those_whose_rewards_differ():
    r = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5000001])
    assert informative(r, 3) == [False, False, True]


def test_gathered_keeps_whole_informative_groups_up_to_the_batch_and_relabels_prompts():
    n, got = 2, Gathered(2, want=2)
    ex = ["p0", "p1", "p2"]
    comps = [comp(p, s) for p in range(3) for s in range(n)]
    got.add(ex, comps, torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]), [True, True, False, True, True, False])
    assert got.examples == ["p1", "p2"] and got.full  # p0's group (1, 1) has no spread: filtered
    assert [(c.prompt_index, c.sample_index) for c in got.comps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got.rewards == [0.0, 1.0, 1.0, 0.0] and got.filtered == 1 and got.surplus == 0
    got.add(ex, comps, torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0]), [False, True, False, False, True, True])
    assert len(got.comps) == 4 and got.surplus == 1 and got.filtered == 3 and got.rounds == 2  # past the batch
    m = got.metrics()
    assert m["rollout/gen_rounds"] == 2 and m["rollout/filtered_groups"] == 3 and m["rollout/surplus_groups"] == 1
    assert m["rollout/informative_groups"] == 2
    assert m["rollout/round_limit"] == 0.0


def test_a_round_limit_reached_short_of_the_batch_is_reported():
    got = Gathered(2, want=2)
    for _ in range(3):  # the trainer's loop ran out of rounds with one informative group in hand
        got.add(["p0"], [comp(0, s) for s in range(2)], torch.tensor([0.0, 0.0]), [False] * 2)
    got.add(["p0"], [comp(0, s) for s in range(2)], torch.tensor([0.0, 1.0]), [False, True])
    m = got.metrics()
    assert m["rollout/round_limit"] == 1.0 and m["rollout/informative_groups"] == 1 and len(got.comps) == 2
    assert "rollout/round_limit" not in Gathered(2, want=0).metrics()  # dynamic sampling off: no rounds to run out


def test_the_filter_compares_accuracy_by_default_and_total_rewards_when_asked():
    """DAPO filters on accuracy: a group all right but for one response a token into the overlong window (its reward
    1 - 1/L_cache) is not informative under acc; under reward it is, with GRPO advantages of about +0.35 / -2.47 from
    the length term alone. A group with right and wrong answers is informative under both."""
    n, max_tokens, buffer = 8, 64, 16
    lengths = [20] * 7 + [max_tokens - buffer + 1]
    terms, _ = overlong_terms(lengths, max_tokens, buffer, 1.0)
    rewards = torch.tensor([1.0 + t for t in terms] + [1.0, 0.0] * 4)
    correct = [True] * 8 + [True, False] * 4
    comps = [comp(p, s, lengths[s]) for p in range(2) for s in range(n)]
    by_acc, by_reward = Gathered(n, want=2), Gathered(n, want=2, metric="reward")
    for got in (by_acc, by_reward):
        got.add(["overlong", "mixed"], comps, rewards, correct)
    assert by_acc.examples == ["mixed"] and by_acc.filtered == 1 and by_acc.reward_only == 1
    assert by_reward.examples == ["overlong", "mixed"] and by_reward.filtered == 0
    adv = group_advantages(torch.tensor(by_reward.rewards[:n]), n)
    assert adv[:7].tolist() == pytest.approx([0.354] * 7, abs=1e-3) and float(adv[7]) == pytest.approx(-2.475, abs=1e-3)


def test_off_keeps_every_group_of_the_one_round():
    got = Gathered(2, want=0)
    got.add(["a", "b"], [comp(p, s) for p in range(2) for s in range(2)], torch.tensor([1.0, 1.0, 0.0, 1.0]), [False] * 4)
    assert got.examples == ["a", "b"] and got.filtered == 0 and not got.full
    assert got.metrics()["rollout/informative_groups"] == 1


def test_round_metrics_merge_counts_means_and_recomputed_rates():
    a = {"reward/mean": 0.0, "reward/errors": 1, "reward/math/mean": 0.25, "acc/mean": 0.0}
    b = {"reward/mean": 1.0, "reward/errors": 2, "reward/math/mean": 1.0, "acc/mean": 1.0}
    m = merge([(a, 4), (b, 12)], [0.0] * 4 + [1.0] * 6 + [0.0] * 6, [False] * 10 + [True] * 6, group_size=2)
    assert m["reward/errors"] == 3
    assert m["reward/math/mean"] == pytest.approx((0.25 * 4 + 1.0 * 12) / 16)
    assert m["reward/mean"] == pytest.approx(6 / 16) and m["acc/mean"] == pytest.approx(6 / 16)
    assert m["reward/frac_zero_std"] == 1.0  # every pair of samples is equal
    r = merge_rollout([({"perf/gen_tokens_per_s": 10.0, "rollout/peak_running": 8, "spec/accept_length": 1.0}, 100, 10.0),
                       ({"perf/gen_tokens_per_s": 50.0, "rollout/peak_running": 4, "spec/accept_length": 2.0}, 300, 6.0)])
    assert r["perf/gen_tokens_per_s"] == pytest.approx(400 / 16) and r["rollout/peak_running"] == 8
    assert r["spec/accept_length"] == pytest.approx((100 + 600) / 400)


def constant(prompts, completions, **_):
    return [1.0] * len(completions)


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# a shaped reward the accuracy verifier cannot judge: dynamic sampling filters on its total
DS = ("algo.dynamic_sampling=true", "reward.functions=[tests.rl_helpers:odd_prompts_only]", "algo.mini_batch_size=8",
      "trainer.prompts_per_step=2", "rollout.n=4", "algo.max_gen_rounds=4", "algo.filter_metric=reward")


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_and_resumes_exactly(tiny_chat, task_file, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(tiny_chat, task_file, full, *DS, "trainer.steps=3"))
    rows = _rows(full)
    for r in rows:  # every step trained on its 2 informative groups, or on those found when the rounds ran out
        check_rounds(r, 2, 4)
        assert r["rollout/filtered_groups"] >= 0
    assert sum(r["rollout/gen_rounds"] for r in rows) > 3  # half the prompts give equal rewards: rounds were added
    assert sum(r["rollout/filtered_groups"] for r in rows) >= 1
    train(tiny_cfg(tiny_chat, task_file, part, *DS, "trainer.steps=2"))
    train(tiny_cfg(tiny_chat, task_file, part, *DS, "trainer.steps=3", "trainer.resume=true"))
    a, b = rows[2], _rows(part)[2]
    for key in ("reward/mean", "rollout/gen_rounds", "rollout/filtered_groups", "actor/pg_loss", "response_lengths"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "checkpoints" / "step_000003" / "model" / "model.safetensors")) for d in (full, part))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa), "weights differ after step 3"


@pytest.mark.slow
def test_dynamic_sampling_stops_at_max_gen_rounds_without_an_update(tiny_chat, task_file, tmp_path):
    cfg = tiny_cfg(tiny_chat, task_file, tmp_path, *DS, "reward.functions=[tests.rl.test_dynamic:constant]",
                   "algo.max_gen_rounds=3", "trainer.steps=4", "trainer.save_every=0")
    rows = _rows(train(cfg))  # 4 steps with nothing to learn: the run does not stop (no error, no skipped update)
    assert len(rows) == 4
    for r in rows:
        assert r["rollout/gen_rounds"] == 3 and r["rollout/filtered_groups"] == 6
        assert r["rollout/informative_groups"] == 0 and "actor/pg_loss" not in r and r["rollout/round_limit"] == 1.0
        assert len(r["response_lengths"]) == 3 * 2 * 4  # every round's samples are in the lengths
