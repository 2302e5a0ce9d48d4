import math

import pytest
import torch

from tailrl.rl.algos import (aggregate, cispo_loss, group_advantages, gspo_loss, kl_penalty, loss_agg, policy_loss,
                             token_logprobs)


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


def test_seq_means_leave_fully_masked_rows_out_of_their_count():
    """A row with no token on the mask (a response masked by algo.mask_truncated) is in no normaliser: verl's
    agg_loss averages over the sequences left, so two kept rows of three weigh 1/2 each, not 1/3."""
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(v, torch.zeros_like(m), "seq-mean-token-mean")) == 0.0  # nothing left: 0, not NaN


def test_loss_agg_auto_is_each_losss_paper():
    """GSPO's objective (arXiv 2507.18071 eq. 5-7) and verl's compute_policy_loss_gspo weigh each response equally;
    PPO (DAPO) and CISPO (MiniMax-M1 eq. 4) average over tokens. An explicit mode wins."""
    assert [loss_agg(x, "auto") for x in ("ppo", "gspo", "cispo")] == ["token-mean", "seq-mean-token-mean", "token-mean"]
    assert loss_agg("gspo", "token-mean") == "token-mean"


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    """verl's compute_policy_loss_vanilla with clip_ratio_c = 3: for A < 0 the loss is min(PPO's, -A * 3), so a ratio
    of 5 costs 3 |A| with no gradient; a positive advantage, and ratios below 3, are PPO's."""
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    logp = torch.log(torch.tensor([[5.0, 2.0, 0.5]])).requires_grad_()
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.28, "token-mean", clip_c=3.0)
    assert float(loss) == pytest.approx((3.0 + 2.0 + 0.8) / 3)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(2.0 / 3)  # capped token: no gradient
    off, _ = policy_loss(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.28, "token-mean")
    assert float(off) == pytest.approx((5.0 + 2.0 + 0.8) / 3)
    pos, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.28, "token-mean", clip_c=3.0)
    assert float(pos) == pytest.approx(-(1.28 + 1.28 + 0.5) / 3)


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


def leaf(rows):
    """logp as a leaf with a gradient; old logp 0, so each token's log ratio is its logp."""
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def test_gspo_loss_and_gradient_by_hand():
    """Two responses, 2 and 3 tokens (the third row's last token is padding). s_0 = exp(mean(0.1, 0.3)) = e^0.2 sits
    above 1 + 4e-4 with A = +1: clipped, zero gradient. s_1 = exp(2e-4) is inside the clip, A = -2: each of its 3
    tokens gets d/dlogp_t of (1/2)(1/3) sum_t (2 s_1) = s_1 / 3 (seq-mean-token-mean, the paper's)."""
    logp = leaf([[0.1, 0.3, 0.0], [1e-4, 2e-4, 3e-4]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, info = gspo_loss(logp, torch.zeros_like(logp), adv, mask, 3e-4, 4e-4, "seq-mean-token-mean")
    s1 = math.exp(2e-4)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 2 * s1) / 2, rel=1e-12)
    assert info["pg_clipfrac"] == pytest.approx(2 / 5)  # the clipped response's 2 tokens of 5
    assert info["ppo_kl"] == pytest.approx(-(0.4 + 6e-4) / 5)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0] + [s1 / 3] * 3, rel=1e-12)


def test_gspo_negative_advantage_clips_below_and_not_above():
    """A < 0: a sequence ratio below 1 - clip_low is clipped (no gradient), one above 1 + clip_high is not:
    its gradient is -A s / |y| per token (one response here, so the sequence mean is the response's)."""
    mask = torch.ones(1, 2, dtype=torch.float64)
    for rows, clipped in (([[-0.01, -0.03]], True), ([[0.01, 0.03]], False)):
        logp = leaf(rows)
        loss, info = gspo_loss(logp, torch.zeros_like(logp), torch.tensor([-1.0], dtype=torch.float64), mask,
                               3e-4, 4e-4, "seq-mean-token-mean")
        loss.backward()
        s = math.exp(sum(rows[0]) / 2)
        want = [0.0, 0.0] if clipped else [s / 2, s / 2]
        assert loss.item() == pytest.approx(1 - 3e-4 if clipped else s, rel=1e-12)
        assert logp.grad.tolist()[0] == pytest.approx(want, rel=1e-12) and info["pg_clipfrac"] == float(clipped)


def test_gspo_ratio_is_length_normalised_and_matches_the_sequence_form():
    """The same per-token log ratio d on responses of 1 and 4 tokens gives the same ratio e^d (not e^{4d}); and
    the token form's loss and gradient equal sequence-level GSPO written out on its own (eq. 5-7: one ratio per
    response, the min of the clipped and unclipped surrogate, averaged over the responses), for random inputs."""
    d = 0.05
    logp = leaf([[d, 0.0, 0.0, 0.0], [d, d, d, d]])
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    loss, _ = gspo_loss(logp, torch.zeros_like(logp), torch.tensor([1.0, 1.0], dtype=torch.float64), mask,
                        0.2, 0.2, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-math.exp(d), rel=1e-12)  # both responses' ratio is e^d
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 7, generator=gen) < 0.8).double()
    mask[:, 0] = 1
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    new = old + torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.02
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    token_form, info = gspo_loss(a, old, adv, mask, 0.003, 0.004, "seq-mean-token-mean")
    token_form.backward()
    s = torch.exp(((b - old) * mask).sum(-1) / mask.sum(-1))
    seq_form = torch.maximum(-adv * s, -adv * s.clamp(1 - 0.003, 1 + 0.004)).mean()
    seq_form.backward()
    assert 0 < info["pg_clipfrac"] < 1, "the case needs clipped and unclipped responses"
    assert token_form.item() == pytest.approx(seq_form.item(), rel=1e-12)
    torch.testing.assert_close(a.grad, b.grad * mask, rtol=1e-10, atol=1e-14)


def test_cispo_loss_and_gradient_by_hand():
    """Ratios 1.5, 0.5 and 7 (old logp 0), A = +1, the weight capped at 1 + 4 = 5 and no lower bound:
    loss = -(1.5 logp_0 + 0.5 logp_1 + 5 logp_2) / 3 (token-mean); the gradient at each token is -w_t A / 3,
    nonzero at the clipped token too (-5/3), where PPO's would be 0."""
    logp = leaf([[math.log(1.5), math.log(0.5), math.log(7.0)]])
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, info = cispo_loss(logp, torch.zeros_like(logp), torch.tensor([1.0], dtype=torch.float64), mask, 1.0, 4.0)
    lp = [math.log(1.5), math.log(0.5), math.log(7.0)]
    assert loss.item() == pytest.approx(-(1.5 * lp[0] + 0.5 * lp[1] + 5 * lp[2]) / 3, rel=1e-12)
    assert info["pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 3, -0.5 / 3, -5 / 3], rel=1e-12)
    # a lower bound (1 - 0.2) lifts the 0.5 weight to 0.8; a negative advantage flips every gradient's sign
    logp.grad = None
    loss, info = cispo_loss(logp, torch.zeros_like(logp), torch.tensor([-2.0], dtype=torch.float64), mask, 0.2, 4.0)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([2 * 1.5 / 3, 2 * 0.8 / 3, 2 * 5 / 3], rel=1e-12)
    assert info["pg_clipfrac"] == pytest.approx(2 / 3)


def test_gspo_and_cispo_take_tis_weights_like_ppo():
    """weights multiply each token's loss, detached: at ratio 1 (old = logp) the gradient of each loss at token t
    is -A w_t / N (token-mean over N tokens): PPO's and CISPO's by their formulas, GSPO's since s = 1 is inside
    its clip and each token's gradient is s A w_t / N."""
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, 2.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([1.5], dtype=torch.float64)
    for fn in (policy_loss, gspo_loss, cispo_loss):
        logp = leaf([[-1.0, -2.0, 0.0]])
        loss, _ = fn(logp, logp.detach(), adv, mask, agg="token-mean", weights=w)
        loss.backward()
        assert logp.grad.tolist()[0] == pytest.approx([-1.5 * 0.5 / 2, -1.5 * 2.0 / 2, 0.0], rel=1e-12), fn.__name__


def test_lr_schedule_warmup_constant_and_cosine_ends():
    from tailrl.rl.algos import lr_at

    assert [lr_at(1.0, "constant", k, 8, warmup=3) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = [lr_at(1.0, "cosine", k, 16, min_ratio=0.1) for k in range(16)]
    assert cos[0] == 1.0 and abs(cos[-1] - 0.1) < 1e-12  # from the peak at the first step to the floor at the last
    assert all(a > b for a, b in zip(cos, cos[1:]))
    assert abs(cos[15 // 2] - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))) < 1e-12
    assert lr_at(1.0, "cosine", 20, 16, min_ratio=0.1) == pytest.approx(0.1)  # past the end: the floor
    with pytest.raises(ValueError, match="cosine"):
        lr_at(1.0, "linear", 3, 16)
