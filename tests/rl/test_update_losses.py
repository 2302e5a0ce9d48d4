"""The update with each policy loss (`algo.loss`: ppo, gspo, cispo) on the tiny model: at the rollout policy they
give one gradient; once the policy has moved within the batch they move the weights each its own way (their math
against hand-computed values: test_algos.py)."""

import copy
import math
import random

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.rl.actor.forward import make_batch, mask_truncated
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import policy_update
from tests.helpers import tiny_model
from tests.rl.update_helpers import GRAD_ATOL, GRAD_RTOL, GradRecorder, comps

LOSSES = ("ppo", "gspo", "cispo")
ADV = torch.tensor([0.9, -0.3, -0.6, 1.1, -1.1, 0.5, -0.5, 0.2])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32).requires_grad_(True)


def update(model, loss, opt_of, **algo):
    master = copy.deepcopy(model)
    opt = opt_of(master.parameters())
    metrics, why = policy_update(Precision(master, "float32"), opt, None, make_batch(comps(seed=11, n=8), pad=0), ADV,
                                 AlgoCfg(loss=loss, **algo), 0.9, random.Random(0), {})
    assert why is None, loss
    return master, opt, metrics


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


def test_at_the_rollout_policy_the_three_losses_give_one_gradient(tiny):
    """Ratio 1 everywhere (nothing moves the weights), one aggregation (token-mean) for all three: PPO's gradient is
    -A/N grad logp per token,
    GSPO's s A / N with s = 1 inside its clip, CISPO's -1 * A / N: the gradients handed to the optimizer agree."""
    grads = {loss: update(tiny, loss, GradRecorder, mini_batch_size=4, micro_batch_size=2, loss_agg="token-mean")[1].grads
             for loss in LOSSES}
    assert len(grads["ppo"]) == 2
    for loss in ("gspo", "cispo"):
        for step_a, step_b in zip(grads["ppo"], grads[loss]):
            for a, b in zip(step_a, step_b):
                torch.testing.assert_close(b, a, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=loss)


def test_each_policy_loss_updates_the_tiny_model(tiny):
    """Two mini-batches at lr 1e-2: the second sees ratios away from 1, which PPO clips at [0.8, 1.28], GSPO clips
    per response at 1 -/+ 3e-4/4e-4 and CISPO weighs without dropping a token; each run moves the weights, and
    the three land in different places."""
    after = {}
    for loss in LOSSES:
        master, _, metrics = update(tiny, loss, adamw, mini_batch_size=4, micro_batch_size=2)
        assert all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")), loss
        assert 0 <= metrics["actor/pg_clipfrac"] <= 1
        if loss != "cispo":  # CISPO's weight cap (5) is far from these ratios
            assert metrics["actor/pg_clipfrac"] > 0, loss
        moved = max(float((p - q).detach().abs().max()) for p, q in zip(master.parameters(), tiny.parameters()))
        assert moved > 1e-3, loss
        after[loss] = master
    for a, b in (("ppo", "gspo"), ("ppo", "cispo"), ("gspo", "cispo")):
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(after[a].parameters(), after[b].parameters()))
        assert diff > 1e-3, (a, b)


def test_gspo_weighs_each_response_equally_by_default(tiny):
    """algo.loss=gspo with loss_agg left at auto takes the paper's seq-mean-token-mean (verl's gspo loss does too):
    the gradient handed to the optimizer is that of the explicit mode, and not token-mean's (responses of 1-14
    tokens here, so the two weigh them differently)."""
    kw = dict(mini_batch_size=8, micro_batch_size=4)
    auto = update(tiny, "gspo", GradRecorder, **kw)[1].grads[0]
    seq = update(tiny, "gspo", GradRecorder, loss_agg="seq-mean-token-mean", **kw)[1].grads[0]
    tok = update(tiny, "gspo", GradRecorder, loss_agg="token-mean", **kw)[1].grads[0]
    for a, b in zip(auto, seq):
        torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert max(float((a - b).abs().max()) for a, b in zip(auto, tok)) > 100 * GRAD_ATOL


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_means_leave_truncated_responses_out_of_the_count(tiny, agg):
    """algo.mask_truncated takes a response out of the loss: under a seq-mean the update's gradient is that of the
    batch without it (verl leaves fully masked rows out of the sequence count), not that one scaled by kept/total."""
    all_comps, cut = comps(seed=11, n=8), [False, True, False, False, True, False, False, False]
    kept = [c for c, x in zip(all_comps, cut) if not x]
    algo = AlgoCfg(loss_agg=agg, mini_batch_size=8, micro_batch_size=3, grad_clip=1e6)  # unclipped: scale shows
    whole = make_batch(all_comps, pad=0)
    adv = mask_truncated(whole, ADV, cut)
    without = make_batch(kept, pad=0)
    for a, b in zip(grads_of(tiny, whole, adv, algo)[0], grads_of(tiny, without, ADV[[not x for x in cut]], algo)[0]):
        torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def grads_of(model, batch, adv, algo) -> list:
    """The gradients each optimizer step of the update gets (GradRecorder: the weights do not move)."""
    master = copy.deepcopy(model)
    opt = GradRecorder(master.parameters())
    _, why = policy_update(Precision(master, "float32"), opt, None, batch, adv, algo, 0.9, random.Random(0), {})
    assert why is None
    return opt.grads


def test_dual_clip_reaches_the_update_and_is_checked(tiny):
    """algo.clip_ratio_c goes to PPO's loss: at 1.01 the second mini-batch's negative-advantage tokens whose ratio
    moved above 1.01 lose their gradient, so the weights land elsewhere than without it; values that are no dual
    clip (<= 1) or a loss other than PPO are refused by name."""
    from tailrl.config import ConfigError, load_config

    off = update(tiny, "ppo", adamw, mini_batch_size=4, micro_batch_size=2)[0]
    on, _, metrics = update(tiny, "ppo", adamw, mini_batch_size=4, micro_batch_size=2, clip_ratio_c=1.01)
    assert math.isfinite(metrics["actor/pg_loss"])
    assert max(float((p - q).detach().abs().max()) for p, q in zip(on.parameters(), off.parameters())) > 1e-3
    for bad in (["algo.clip_ratio_c=0.5"], ["algo.clip_ratio_c=3", "algo.loss=gspo"]):
        with pytest.raises(ConfigError, match="algo.clip_ratio_c"):
            load_config(None, bad)
    assert load_config(None, ["algo.clip_ratio_c=3"]).algo.clip_ratio_c == 3.0
