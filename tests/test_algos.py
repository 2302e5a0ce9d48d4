import math

import pytest
import torch

from tailrl.rl.algos import aggregate, group_advantages, kl_penalty, policy_loss, token_logprobs


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # a group with equal rewards gives no signal


def test_dr_grpo_does_not_divide_by_std():
    r = torch.tensor([3.0, 1.0, 0.0, 0.0])
    assert group_advantages(r, 2, norm_std=False).tolist() == [1.0, -1.0, 0.0, 0.0]


def test_aggregation_modes_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(v, m, "mean")


def test_clipped_loss_by_hand_and_clip_higher():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([1.0])
    # positive advantage: ratio 1.5 clipped to 1 + 0.2; ratio 0.5 unclipped (min of surrogate)
    loss, info = policy_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean")
    assert float(loss) == pytest.approx(-(1.2 + 0.5) / 2)
    assert info["pg_clipfrac"] == pytest.approx(0.5)
    # clip-higher lets the positive-advantage ratio go to 1.28
    loss_hi, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, "token-mean")
    assert float(loss_hi) == pytest.approx(-(1.28 + 0.5) / 2)
    # negative advantage: ratio 0.5 is clipped at 1 - clip_low, 1.5 is not
    loss_neg, _ = policy_loss(logp, old, -adv, mask, 0.2, 0.28, "token-mean")
    assert float(loss_neg) == pytest.approx((1.5 + 0.8) / 2)


def test_aggregation_changes_the_loss():
    logp = torch.log(torch.tensor([[1.1, 1.1, 1.1], [1.1, 0.0, 0.0]]).clamp_min(1e-9))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 3)
    tm, _ = policy_loss(logp, old, adv, mask, agg="token-mean")
    sm, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    assert float(tm) == pytest.approx((-1.1 * 3 + 1.1) / 4)
    assert float(sm) == pytest.approx((-1.1 + 1.1) / 2)


def test_policy_gradient_points_towards_positive_advantage():
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    tokens = torch.tensor([[1]])
    logp, ent = token_logprobs(logits, tokens)
    assert float(ent.detach()) == pytest.approx(math.log(3))
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert logits.grad[0, 0, 1] < 0 and logits.grad[0, 0, 0] > 0  # descent raises the sampled token


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(kl_penalty(ref, ref, "k3")) == 0.0
    with pytest.raises(ValueError, match="KL"):
        kl_penalty(logp, ref, "k2")


def test_temperature_scales_token_logprobs():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp, _ = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert float(lp) == pytest.approx(math.log(math.e / (math.e + 1)))
